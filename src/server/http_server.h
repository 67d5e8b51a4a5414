#pragma once
// The OpenAI-compatible HTTP server: owns the cpp-httplib server, the scheduler and the metrics.
// It listens at once and answers /healthz; the model endpoints and /readyz answer 503 until
// set_model() and set_ready(true) (after loading and warm-up).

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "server/generation_engine.h"
#include "server/metrics.h"
#include "server/request_parser.h"
#include "tokenizer/chat_encoding.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace uf::server {

class Scheduler;

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;                   // 0: pick a free port (tests)
  int max_seq = 65536;               // prompt + completion tokens per request
  size_t max_queue = 64;             // waiting requests before HTTP 429
  size_t max_prepared = 6;           // prepared requests waiting for the engine
  size_t max_body_bytes = 8u << 20;  // larger bodies get HTTP 413
  int read_timeout_s = 30;           // a client that stalls while sending its request
  int write_timeout_s = 30;          // a client that stops reading its response
  int keep_alive_timeout_s = 5;
  int http_threads = 0;           // 0: max_queue + 16 (every queued request holds one)
  std::string served_model_name;  // empty: the engine's model_name()
  std::string system_fingerprint = "uf-0.1";
  ParserOptions parser;  // request limits and the sampling defaults
};

class HttpServer {
 public:
  explicit HttpServer(ServerConfig config);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The model: engine and chat encoder (tokenizer). Starts the scheduler's threads.
  void set_model(std::shared_ptr<GenerationEngine> engine,
                 std::shared_ptr<const tokenizer::ChatEncoder> encoder);
  // /readyz answers 200 and the model endpoints accept requests once this is true.
  void set_ready(bool ready) { ready_.store(ready); }
  bool ready() const { return ready_.load(); }

  // Binds host:port; returns the bound port. Throws uf::core::Error when it cannot bind.
  int bind();
  // Serves until stop(); call bind() first.
  void serve();
  // bind() + serve() on a background thread (tests, benchmarks).
  int start_background();
  // Stops accepting, cancels queued and running requests, joins threads.
  void stop();

  MetricsRegistry& registry() { return registry_; }
  ServerMetrics& metrics() { return *metrics_; }
  const ServerConfig& config() const { return config_; }

 private:
  friend class CompletionHandler;
  void install_routes();
  void handle_completion(const httplib::Request& req, httplib::Response& res, Endpoint ep);

  ServerConfig config_;
  MetricsRegistry registry_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<httplib::Server> http_;
  std::shared_ptr<GenerationEngine> engine_;
  std::shared_ptr<const tokenizer::ChatEncoder> encoder_;
  std::unique_ptr<Scheduler> scheduler_;
  std::atomic<bool> ready_{false};
  std::atomic<bool> stopped_{false};
  std::thread background_;
  int port_ = -1;
};

}  // namespace uf::server
