#include "server/http_server.h"

#include <httplib.h>

#include <chrono>

#include "core/error.h"
#include "core/log.h"
#include "server/api_error.h"
#include "server/scheduler.h"

namespace uf::server {
namespace {

void send_error(httplib::Response& res, int status, const std::string& message,
                const std::string& type, const std::string& code = {}) {
  res.status = status;
  res.set_content(error_body(message, type, "", code).dump(), "application/json");
}

const char* kJson = "application/json";

}  // namespace

HttpServer::HttpServer(ServerConfig config)
    : config_(std::move(config)),
      metrics_(std::make_unique<ServerMetrics>(registry_)),
      http_(std::make_unique<httplib::Server>()) {
  UF_CHECK(config_.max_seq >= 2, "--max-seq must be at least 2, got {}", config_.max_seq);
  UF_CHECK(config_.max_queue >= 1, "--max-queue must be at least 1");
  UF_CHECK(config_.max_prepared >= 1, "--max-prepared must be at least 1");
  size_t threads = config_.http_threads > 0 ? size_t(config_.http_threads) : config_.max_queue + 16;
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http_->set_payload_max_length(config_.max_body_bytes);
  http_->set_read_timeout(config_.read_timeout_s, 0);
  http_->set_write_timeout(config_.write_timeout_s, 0);
  http_->set_keep_alive_timeout(config_.keep_alive_timeout_s);
  http_->set_keep_alive_max_count(1000);  // clients with connection pools reuse connections
  http_->set_tcp_nodelay(true);           // SSE chunks are small; do not wait for Nagle
  install_routes();
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::set_model(std::shared_ptr<GenerationEngine> engine,
                           std::shared_ptr<const tokenizer::ChatEncoder> encoder) {
  UF_CHECK(engine && encoder, "HttpServer::set_model needs an engine and a chat encoder");
  UF_CHECK(!scheduler_, "HttpServer::set_model may be called only once");
  engine_ = std::move(engine);
  encoder_ = std::move(encoder);
  if (config_.served_model_name.empty()) config_.served_model_name = engine_->model_name();
  scheduler_ = std::make_unique<Scheduler>(
      *engine_, *metrics_, SchedulerConfig{config_.max_queue, config_.max_prepared});
  scheduler_->start();
}

void HttpServer::install_routes() {
  auto& s = *http_;
  s.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("{\"status\":\"ok\"}", kJson);
  });
  s.Get("/readyz", [this](const httplib::Request&, httplib::Response& res) {
    if (ready()) {
      res.set_content("{\"status\":\"ready\"}", kJson);
    } else {
      res.set_header("Retry-After", "1");
      send_error(res, 503, "The model is loading; retry shortly.", "unavailable_error",
                 "model_loading");
    }
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry_.render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  auto models = [this](const httplib::Request& req, httplib::Response& res) {
    nlohmann::json card = {{"id", config_.served_model_name},
                           {"object", "model"},
                           {"created", 0},
                           {"owned_by", "ultrafast"},
                           {"max_model_len", config_.max_seq}};
    if (req.matches.size() > 1) {
      if (req.matches[1] != config_.served_model_name) {
        send_error(res, 404, "The model '" + std::string(req.matches[1]) + "' does not exist.",
                   "invalid_request_error", "model_not_found");
        return;
      }
      res.set_content(card.dump(), kJson);
      return;
    }
    res.set_content(nlohmann::json{{"object", "list"}, {"data", {card}}}.dump(), kJson);
  };
  s.Get("/v1/models", models);
  s.Get(R"(/v1/models/([^/]+))", models);
  s.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_completion(req, res, Endpoint::kChat);
  });
  s.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_completion(req, res, Endpoint::kCompletion);
  });

  // Known paths with the wrong method: 405 with Allow (cpp-httplib alone would say 404).
  auto not_allowed = [](const char* allow) {
    return [allow](const httplib::Request& req, httplib::Response& res) {
      res.set_header("Allow", allow);
      send_error(res, 405,
                 "Method " + req.method + " is not allowed on " + req.path + "; use " + allow + ".",
                 "invalid_request_error", "method_not_allowed");
    };
  };
  for (const char* p : {"/v1/chat/completions", "/v1/completions"}) {
    s.Get(p, not_allowed("POST"));
    s.Put(p, not_allowed("POST"));
    s.Patch(p, not_allowed("POST"));
    s.Delete(p, not_allowed("POST"));
  }
  for (const char* p : {"/healthz", "/readyz", "/metrics", "/v1/models", R"(/v1/models/[^/]+)"}) {
    s.Post(p, not_allowed("GET"));
    s.Put(p, not_allowed("GET"));
    s.Patch(p, not_allowed("GET"));
    s.Delete(p, not_allowed("GET"));
  }

  // Statuses cpp-httplib sets itself (404 unknown path, 413 body too large, 400 unparsable
  // request line, ...) get an OpenAI-shaped body here.
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string message, type = "invalid_request_error", code;
    switch (res.status) {
      case 404:
        message = "Unknown path: " + req.method + " " + req.path + ".";
        code = "not_found";
        break;
      case 413:
        message = "The request body is larger than the server's limit.";
        code = "request_too_large";
        break;
      case 414:
        message = "The request URI is too long.";
        break;
      default:
        message = "The request could not be handled (HTTP " + std::to_string(res.status) + ").";
        if (res.status >= 500) type = "server_error";
    }
    res.set_content(error_body(message, type, "", code).dump(), kJson);
  });
  s.set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        spdlog::error("unhandled error on {} {}: {}", req.method, req.path, what);
        send_error(res, 500, "Internal server error: " + what, "server_error");
      });
}

int HttpServer::bind() {
  if (config_.port == 0) {
    port_ = http_->bind_to_any_port(config_.host);
    UF_CHECK(port_ > 0, "cannot bind an HTTP port on {}", config_.host);
  } else {
    UF_CHECK(http_->bind_to_port(config_.host, config_.port),
             "cannot bind HTTP server to {}:{} (in use, or not a local address?)", config_.host,
             config_.port);
    port_ = config_.port;
  }
  return port_;
}

void HttpServer::serve() {
  UF_CHECK(port_ > 0, "HttpServer::serve() called before bind()");
  http_->listen_after_bind();
}

int HttpServer::start_background() {
  int port = bind();
  background_ = std::thread([this] { serve(); });
  // listen_after_bind() marks the server running only once its loop starts.
  for (int i = 0; i < 2000 && !http_->is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return port;
}

void HttpServer::stop() {
  if (stopped_.exchange(true)) return;
  ready_.store(false);
  if (scheduler_) scheduler_->stop();  // wakes every worker waiting on a job
  http_->stop();
  if (background_.joinable()) background_.join();
}

}  // namespace uf::server
