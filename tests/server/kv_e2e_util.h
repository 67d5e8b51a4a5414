#pragma once
// Shared pieces of the multi-server KV-sharing tests (loopback and network namespaces): stopping
// a child process, and the conversation whose turns move between servers.

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

namespace uf::server::testing {

// SIGTERM, up to 2 s for a clean exit, then SIGKILL; reaps the child. Sets pid to -1.
inline void stop_child(pid_t& pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  for (int i = 0; i < 100; ++i) {
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) == pid) {
      pid = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
  pid = -1;
}

// The conversation: turn k's messages are the earlier turns, their answers and a new question.
inline nlohmann::json conversation_turn1() {
  return nlohmann::json::array({{{"role", "user"}, {"content", "hello world"}}});
}
inline nlohmann::json conversation_turn2(const std::string& answer1) {
  nlohmann::json m = conversation_turn1();
  m.push_back({{"role", "assistant"}, {"content", answer1}});
  m.push_back({{"role", "user"}, {"content", "more words please"}});
  return m;
}

}  // namespace uf::server::testing
