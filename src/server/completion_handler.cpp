// POST /v1/chat/completions and /v1/completions: validate, tokenise, admit to the queue, then
// relay generated text to the client (whole, or as SSE chunks) and log one request_end line.

#include <httplib.h>
#include <sys/socket.h>

#include <random>

#include "core/error.h"
#include "core/log.h"
#include "server/api_error.h"
#include "server/connection_watch.h"
#include "server/http_server.h"
#include "server/response_builder.h"
#include "server/scheduler.h"

namespace uf::server {
namespace {

using nlohmann::json;

std::string random_id(const char* prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* kAlnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id.push_back(kAlnum[rng() % 62]);
  return id;
}

constexpr size_t kMaxTokensPerEvent = 64;
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(100);

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

bool is_json_media_type(const std::string& ct) {
  std::string base = ct.substr(0, ct.find(';'));
  while (!base.empty() && base.back() == ' ') base.pop_back();
  for (auto& c : base) c = char(std::tolower(static_cast<unsigned char>(c)));
  return base == "application/json";
}

void reply_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status();
  res.set_content(e.to_json().dump(), "application/json");
}

}  // namespace

// Everything one admitted request needs after the handler returns (the SSE provider runs later
// on the same worker thread).
struct CompletionContext {
  HttpServer* server = nullptr;
  Scheduler* scheduler = nullptr;
  std::shared_ptr<RequestJob> job;
  ParsedRequest req;
  ResponseMeta meta;
  std::string session_hash;  // empty when no X-Session-ID
  bool thinking = false;
  int prompt_tokens = 0;
  int fd = -1;
  std::unique_ptr<OutputAssembler> out;
  bool finalized = false;
  bool client_gone = false;
  bool engine_error = false;
  std::string error_message;

  // Relays tokens until the job ends; `emit` returns false when the client cannot be written.
  void drive(const std::function<bool(const OutputDelta&)>& emit);
  std::string finish_reason() const;
  UsageCounts usage() const;
  // Metrics and the request_end log line; exactly once.
  void finalize(const std::string& outcome);
};

void CompletionContext::drive(const std::function<bool(const OutputDelta&)>& emit) {
  bool stop_hit = false;
  std::vector<int32_t> tokens;
  uint64_t seen_events = 0;
  while (true) {
    bool finished = false;
    tokens.clear();
    // Once decoding runs, steps come every few milliseconds or faster; poll for up to
    // kSpinBeforeSleep before sleeping on the condition variable. Only the one decoding request's
    // worker ever spins.
    if (job->started_flag.load(std::memory_order_acquire)) {
      const auto spin_end = Clock::now() + kSpinBeforeSleep;
      while (job->events.load(std::memory_order_acquire) == seen_events &&
             Clock::now() < spin_end) {
      }
    }
    seen_events = job->events.load(std::memory_order_acquire);
    {
      std::unique_lock lock(job->mu);
      job->cv.wait_for(lock, std::chrono::milliseconds(10),
                       [&] { return !job->pending.empty() || job->finished; });
      tokens.swap(job->pending);
      finished = job->finished;
    }
    // A client that reads slower than the engine generates gets the backlog in events of at most
    // kMaxTokensPerEvent tokens: bounded chunk sizes, and a stop string ends it early.
    for (size_t at = 0; at < tokens.size() && !stop_hit && !client_gone; at += kMaxTokensPerEvent) {
      const size_t n = std::min(kMaxTokensPerEvent, tokens.size() - at);
      OutputDelta d = out->push(std::span<const int32_t>(tokens.data() + at, n));
      if (!d.empty() && !emit(d)) {
        client_gone = true;
        scheduler->cancel(job);
      }
      if (out->stopped()) {
        stop_hit = true;
        scheduler->cancel(job);  // the engine stops at its next step
      }
    }
    if (finished) break;
    if (!client_gone && peer_closed(fd)) {
      client_gone = true;
      scheduler->cancel(job);
    }
  }
  if (job->result.finish == EngineFinish::kError) {
    engine_error = true;
    error_message = job->result.error.empty() ? "the engine failed" : job->result.error;
  }
  if (!client_gone) {
    OutputDelta d = out->finish();
    if (!d.empty() && !emit(d)) client_gone = true;
  }
}

std::string CompletionContext::finish_reason() const {
  if (!out->tool_calls().empty()) return "tool_calls";
  if (out->stopped()) return "stop";
  switch (job->result.finish) {
    case EngineFinish::kStopToken:
      return "stop";
    case EngineFinish::kLength:
      return "length";
    case EngineFinish::kCancelled:
      return "cancelled";
    default:
      return "error";
  }
}

UsageCounts CompletionContext::usage() const {
  UsageCounts u;
  u.prompt_tokens = prompt_tokens;
  u.completion_tokens = out->completion_tokens();
  u.reasoning_tokens = out->reasoning_tokens();
  u.cached_tokens = job->reused_tokens;
  return u;
}

void CompletionContext::finalize(const std::string& outcome) {
  if (finalized) return;
  finalized = true;
  auto& m = server->metrics();
  const auto now = Clock::now();
  json ev;
  {
    std::lock_guard lock(job->mu);
    ev["event"] = "request_end";
    ev["request_id"] = meta.id;
    ev["session"] = session_hash.empty() ? json(nullptr) : json(session_hash);
    ev["endpoint"] = req.endpoint == Endpoint::kChat ? "chat" : "completions";
    ev["stream"] = req.stream;
    ev["prompt_tokens"] = prompt_tokens;
    ev["completion_tokens"] = out->completion_tokens();
    ev["reasoning_tokens"] = out->reasoning_tokens();
    ev["reused_tokens"] = job->reused_tokens;
    ev["kv_source"] = kv_source_name(job->kv_source);
    const auto start = job->started ? job->started_at : now;
    ev["queue_ms"] = ms_between(job->admitted, start);
    ev["ttft_ms"] =
        job->has_first_token ? json(ms_between(job->admitted, job->first_token_at)) : json(nullptr);
    ev["total_ms"] = ms_between(job->admitted, now);
    ev["decode_steps"] = job->decode_steps;
    ev["average_iteration_ms"] =
        job->decode_steps > 0 ? json(job->decode_ms / job->decode_steps) : json(nullptr);
    // Tokens per verify step, the bonus token included (vLLM/SGLang convention, §0.4 anchors).
    ev["average_accept_length"] = job->decode_steps > 0
                                      ? json(double(job->decode_tokens) / job->decode_steps)
                                      : json(nullptr);
    ev["finish_reason"] = outcome;
    if (!error_message.empty()) ev["error"] = error_message;
  }
  core::log_event(ev);
  m.requests_total.with(outcome).add();
  m.request_duration.observe(std::chrono::duration<double>(now - job->admitted).count());
}

void HttpServer::handle_completion(const httplib::Request& http_req, httplib::Response& res,
                                   Endpoint ep) {
  if (!ready() || !scheduler_) {
    res.set_header("Retry-After", "1");
    reply_error(res, ApiError(503, "unavailable_error", "The model is loading; retry shortly.", "",
                              "model_loading"));
    return;
  }
  auto ctx = std::make_shared<CompletionContext>();
  ctx->server = this;
  ctx->scheduler = scheduler_.get();
  ctx->meta.created = std::chrono::duration_cast<std::chrono::seconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  ctx->meta.id = random_id(ep == Endpoint::kChat ? "chatcmpl-" : "cmpl-");
  ctx->meta.model = config_.served_model_name;
  ctx->meta.system_fingerprint = config_.system_fingerprint;
  auto job = std::make_shared<RequestJob>();
  try {
    if (http_req.has_header("Content-Type") &&
        !is_json_media_type(http_req.get_header_value("Content-Type"))) {
      throw ApiError(415, "invalid_request_error",
                     "Unsupported Content-Type '" + http_req.get_header_value("Content-Type") +
                         "'; send application/json.",
                     "", "unsupported_media_type");
    }
    ctx->req = parse_request(http_req.body, ep, config_.parser);
    const std::string session = http_req.get_header_value("X-Session-ID");
    if (ctx->req.has_assistant_turn && session.empty()) {
      throw invalid_request(
          "This request continues a conversation (its messages contain an earlier assistant "
          "turn) but has no X-Session-ID header. Send the conversation's id in X-Session-ID so "
          "that the server can find and reuse its KV cache.",
          "messages", "missing_session_id");
    }
    if (!session.empty()) ctx->session_hash = sha256_hex(session);

    const auto& tok = encoder_->tokenizer();
    std::vector<int32_t> ids;
    try {
      if (ep == Endpoint::kChat) {
        auto prompt = encoder_->encode(ctx->req.chat_body);
        ids = std::move(prompt.ids);
        ctx->thinking = prompt.thinking;
      } else if (ctx->req.prompt_is_ids) {
        for (int32_t id : ctx->req.prompt_ids) {
          if (id >= tok.vocab_size()) {
            throw invalid_request("'prompt' holds token id " + std::to_string(id) +
                                      ", outside the vocabulary (" +
                                      std::to_string(tok.vocab_size()) + " ids).",
                                  "prompt", "invalid_value");
          }
        }
        ids = ctx->req.prompt_ids;
      } else {
        ids = tok.encode(ctx->req.prompt_text);
      }
    } catch (const ::uf::core::Error& e) {
      // The encoder's message names the field; `param` stays null for chat (it may be any).
      throw invalid_request(e.what(), ep == Endpoint::kChat ? "" : "prompt", "invalid_prompt");
    } catch (const nlohmann::json::exception& e) {
      throw invalid_request(std::string("The request could not be encoded: ") + e.what(), "",
                            "invalid_prompt");
    }
    ctx->prompt_tokens = int(ids.size());
    if (ctx->prompt_tokens >= config_.max_seq) {
      throw invalid_request(
          "This model's maximum context length is " + std::to_string(config_.max_seq) +
              " tokens, but the prompt has " + std::to_string(ctx->prompt_tokens) +
              " tokens. Shorten the messages.",
          ep == Endpoint::kChat ? "messages" : "prompt", "context_length_exceeded");
    }
    const int room = config_.max_seq - ctx->prompt_tokens;
    job->gen.request_id = ctx->meta.id;
    job->gen.session_key = ctx->session_hash;
    job->gen.prompt_ids = std::move(ids);
    job->gen.max_new_tokens = std::min(room, ctx->req.max_tokens.value_or(room));
    job->gen.sampling = ctx->req.sampling;
    job->gen.stop_token_ids = {encoder_->eos_id()};
    job->gen.cancel = &job->cancel;
  } catch (const ApiError& e) {
    metrics_->requests_total.with(e.status() == 415 ? "unsupported_media_type" : "invalid").add();
    reply_error(res, e);
    return;
  }
  ctx->job = job;
  ctx->out =
      std::make_unique<OutputAssembler>(encoder_->tokenizer(), ctx->thinking, ctx->req.stop,
                                        ctx->req.has_tools, "call_" + ctx->meta.id.substr(9) + "_");
  ctx->fd = find_connection_socket(http_req.remote_addr, http_req.remote_port, http_req.local_port);
  if (ctx->fd >= 0) {
    // cpp-httplib 0.11 waits for writability with the write timeout but then sends blocking, so a
    // client that stops reading would hold this worker forever; bound the send itself too.
    timeval tv{config_.write_timeout_s, 0};
    setsockopt(ctx->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  if (!scheduler_->submit(job)) {
    metrics_->requests_total.with("queue_full").add();
    res.set_header("Retry-After", "1");
    reply_error(
        res, ApiError(429, "rate_limit_error",
                      "The server's request queue is full (" + std::to_string(config_.max_queue) +
                          " waiting); retry after a moment.",
                      "", "queue_full"));
    return;
  }
  metrics_->prompt_tokens.add(ctx->prompt_tokens);
  res.set_header("X-Request-ID", ctx->meta.id);

  if (!ctx->req.stream) {
    std::string reasoning, content;
    ctx->drive([&](const OutputDelta& d) {
      reasoning += d.reasoning;
      content += d.content;
      return true;
    });
    if (ctx->client_gone) {
      ctx->finalize("cancelled");
      res.status = 499;  // nobody reads it; keeps the connection from being reused
      res.set_header("Connection", "close");
      return;
    }
    if (ctx->engine_error) {
      ctx->finalize("error");
      reply_error(res, ApiError(500, "server_error", "Generation failed: " + ctx->error_message));
      return;
    }
    const std::string fr = ctx->finish_reason();
    json body =
        ep == Endpoint::kChat
            ? chat_completion(ctx->meta,
                              ctx->thinking ? std::optional<std::string>(reasoning) : std::nullopt,
                              content, ctx->out->tool_calls(), fr, ctx->usage())
            : text_completion(ctx->meta, content, fr, ctx->usage());
    res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    ctx->finalize(fr);
    return;
  }

  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [ctx](size_t, httplib::DataSink& sink) {
        const bool chat = ctx->req.endpoint == Endpoint::kChat;
        const bool usage = ctx->req.include_usage;
        auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
        bool ok = true;
        if (chat) {
          ok = write(sse_event(
              chat_chunk(ctx->meta, json{{"role", "assistant"}, {"content", ""}}, "", usage)));
        }
        if (!ok) {
          ctx->client_gone = true;
          ctx->scheduler->cancel(ctx->job);
        }
        ctx->drive([&](const OutputDelta& d) {
          if (!chat)
            return write(sse_event(text_completion_chunk(ctx->meta, d.content, "", usage)));
          json delta = json::object();
          if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
          if (!d.content.empty()) delta["content"] = d.content;
          return write(sse_event(chat_chunk(ctx->meta, std::move(delta), "", usage)));
        });
        if (ctx->client_gone) {
          ctx->finalize("cancelled");
          return false;
        }
        if (ctx->engine_error) {
          ctx->finalize("error");
          write(sse_event(error_body("Generation failed: " + ctx->error_message, "server_error")));
          write(kSseDone);
          sink.done();
          return true;
        }
        const std::string fr = ctx->finish_reason();
        const auto& calls = ctx->out->tool_calls();
        for (size_t i = 0; i < calls.size() && ok; ++i) {
          ok = write(sse_event(chat_chunk(
              ctx->meta, json{{"tool_calls", json::array({tool_call_delta(calls[i], int(i))})}}, "",
              usage)));
        }
        if (ok) {
          ok = write(sse_event(chat ? chat_chunk(ctx->meta, json::object(), fr, usage)
                                    : text_completion_chunk(ctx->meta, "", fr, usage)));
        }
        if (ok && usage) {
          ok = write(sse_event(chat ? chat_usage_chunk(ctx->meta, ctx->usage())
                                    : text_usage_chunk(ctx->meta, ctx->usage())));
        }
        if (ok) ok = write(kSseDone);
        ctx->finalize(ok ? fr : "cancelled");
        if (ok) sink.done();
        return ok;
      },
      [ctx](bool) {
        // The provider never ran or stopped early (client gone before or during the stream).
        if (ctx->finalized) return;
        ctx->client_gone = true;
        ctx->scheduler->cancel(ctx->job);
        std::unique_lock lock(ctx->job->mu);
        ctx->job->cv.wait(lock, [&] { return ctx->job->finished; });
        lock.unlock();
        ctx->finalize("cancelled");
      });
}

}  // namespace uf::server
