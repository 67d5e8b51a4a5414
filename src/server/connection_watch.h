#pragma once
// Finding out that a client went away while its request waits or decodes, without writing to it.
// cpp-httplib 0.11 exposes no socket to handlers, so the connection's socket is found by its
// address pair among this process's descriptors; a peer that closed shows up as EOF or a hang-up.

#include <string>

namespace uf::server {

// The descriptor of the accepted TCP socket whose peer is remote_addr:remote_port and whose local
// port is local_port; -1 if none is found (then only failed writes reveal a disconnect).
int find_connection_socket(const std::string& remote_addr, int remote_port, int local_port);

// True when the peer has closed or reset the connection. Does not consume request bytes.
bool peer_closed(int fd);

// Lower-case hex SHA-256 (OpenSSL) of `text`: the session key derived from X-Session-ID.
std::string sha256_hex(const std::string& text);

}  // namespace uf::server
