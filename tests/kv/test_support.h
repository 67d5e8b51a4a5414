#pragma once
// Test helpers for the KV tests: free loopback ports, temp dirs, and a real redis-server child
// process that is always stopped (destructor), started with no persistence in a temp dir.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

namespace uf::kv::testing {

// A loopback TCP port that was free a moment ago (bind to port 0, read it back, close).
inline int free_loopback_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline bool port_accepts(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / ("uf_kv_" + tag + "_XXXXXX")).string();
    path_ = ::mkdtemp(tmpl.data()) ? tmpl : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline bool have_program(const char* name) {
  return std::system((std::string("command -v ") + name + " > /dev/null 2>&1").c_str()) == 0;
}

class RedisServer {
 public:
  RedisServer() : dir_("redis"), port_(free_loopback_port()) {}
  ~RedisServer() { stop(); }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  int port() const { return port_; }

  // Starts redis-server on the same port as before; waits until it accepts connections.
  bool start(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::string port = std::to_string(port_);
    std::vector<std::string> args = {"redis-server",
                                     "--port",
                                     port,
                                     "--bind",
                                     "127.0.0.1",
                                     "--save",
                                     "",
                                     "--appendonly",
                                     "no",
                                     "--dir",
                                     dir_.path(),
                                     "--logfile",
                                     dir_.path() + "/redis.log"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      // Dies with the test process even when that is killed (e.g. by a ctest timeout).
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::execvp("redis-server", argv.data());
      ::_exit(127);
    }
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (port_accepts(port_)) return true;
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {  // exited early (port taken?)
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    stop();
    return false;
  }

  // SIGKILL by default: the tests simulate a crash; the data goes with it.
  void stop(int sig = SIGKILL) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
  }

  // Runs a redis-cli command against this server; returns its exit status.
  int cli(const std::string& command) const {
    std::string cmd =
        "redis-cli -h 127.0.0.1 -p " + std::to_string(port_) + " " + command + " > /dev/null 2>&1";
    return std::system(cmd.c_str());
  }

 private:
  TempDir dir_;
  int port_;
  pid_t pid_ = -1;
};

}  // namespace uf::kv::testing
