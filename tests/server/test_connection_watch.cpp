// Disconnect detection without writing, and the session-key hash.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/connection_watch.h"

namespace uf::server {
namespace {

TEST(ServerConnectionWatch, PeerClosedSeesEofButNotPendingData) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  EXPECT_FALSE(peer_closed(sv[0]));
  ASSERT_EQ(write(sv[1], "GET", 3), 3);  // a pipelined request is not a disconnect
  EXPECT_FALSE(peer_closed(sv[0]));
  char buf[3];
  ASSERT_EQ(read(sv[0], buf, 3), 3);
  close(sv[1]);
  EXPECT_TRUE(peer_closed(sv[0]));
  close(sv[0]);
  EXPECT_FALSE(peer_closed(-1));
}

TEST(ServerConnectionWatch, Sha256Hex) {
  // FIPS 180-2 test vectors.
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

}  // namespace
}  // namespace uf::server
