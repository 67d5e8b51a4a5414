// `ultrafast serve`: the OpenAI-compatible HTTP server.
//   ultrafast serve --model <dir> [--backend cpu|cuda] [--tp N] [--host 127.0.0.1] [--port 8000]
//   ...
// The server listens at once (/healthz answers, /readyz says 503), then loads the tokenizer and
// the engine, and answers /readyz 200 once the engine is warm. SIGINT/SIGTERM stop it cleanly.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <thread>
#include <tuple>

#include "cli/backend_factory.h"
#include "cli/command_registry.h"
#include "core/error.h"
#include "core/log.h"
#include "server/http_server.h"
#include "server/model_engine.h"
#include "server/sampling_defaults.h"
#include "server/stub_setup.h"

namespace {

struct ServeOptions {
  std::string model;
  std::string tokenizer;  // default: <model>/tokenizer.json
  // The sampling defaults: "auto" (<model>/generation_config.json when there is one), "none"
  // (OpenAI's), or a generation_config.json path.
  std::string generation_config = "auto";
  std::string backend = "cpu";
  int tp = 1;  // tensor-parallel GPUs (--backend cuda)
  uf::cli::CudaSwitches cuda;
  bool stub_engine = false;
  int stub_step_delay_us = 0;
  int stub_max_accept = 6;
  bool no_spec = false;
  std::string verify = "block";
  int draft_tokens = 0;
  uint64_t host_cache_bytes = uint64_t(4) << 30;
  // KV sharing between servers (docs/operations.md); off unless --redis or --kv-listen is given.
  std::string redis;      // HOST:PORT
  std::string kv_listen;  // HOST:PORT
  std::string kv_advertise;
  std::string server_id;
  int kv_fetch_timeout_ms = 10000;
  uint64_t kv_published_bytes = 0;
  int bound_port = 0;  // the HTTP port actually bound (for the default server id)
  uf::server::ServerConfig server;
};

// "HOST:PORT" -> (host, port); throws naming the flag.
std::pair<std::string, int> split_host_port(const std::string& v, const char* flag) {
  auto colon = v.rfind(':');
  UF_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < v.size(),
           "{} expects HOST:PORT, got '{}'", flag, v);
  int port = -1;
  try {
    port = std::stoi(v.substr(colon + 1));
  } catch (...) {
  }
  UF_CHECK(port >= 0 && port <= 65535, "{} has an invalid port in '{}'", flag, v);
  return {v.substr(0, colon), port};
}

// KV sharing settings from the flags, or nullopt for the default single-server path.
std::optional<uf::server::KvSharingOptions> kv_sharing_options(const ServeOptions& o,
                                                               const uf::cli::LoadedBackend& lb) {
  if (o.redis.empty() && o.kv_listen.empty()) return std::nullopt;
  uf::server::KvSharingOptions k;
  if (!o.redis.empty()) std::tie(k.redis_host, k.redis_port) = split_host_port(o.redis, "--redis");
  if (!o.kv_listen.empty()) {
    auto [h, p] = split_host_port(o.kv_listen, "--kv-listen");
    k.listen_host = h;
    k.listen_port = uint16_t(p);
  } else {
    spdlog::warn(
        "--redis without --kv-listen: serving snapshots on an ephemeral loopback port, "
        "reachable only from this host");
  }
  k.advertise_host = o.kv_advertise;
  k.server_id = o.server_id;
  if (k.server_id.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    k.server_id = fmt::format("{}:{}", host, o.bound_port);
  }
  k.fetch_timeout_ms = o.kv_fetch_timeout_ms;
  k.max_published_bytes = o.kv_published_bytes;
  const char* corrupt = std::getenv("UF_TEST_CORRUPT_KV_FETCH");
  k.test_corrupt_fetch = corrupt && std::string(corrupt) == "1";
  if (k.test_corrupt_fetch) spdlog::warn("UF_TEST_CORRUPT_KV_FETCH=1: corrupting fetched KV");
  uf::server::KvFingerprintInputs fi;
  fi.model_dir = o.model;
  fi.tokenizer = o.tokenizer;
  fi.max_seq = o.server.max_seq;
  fi.gpu_count = lb.profile.key.gpu_count;
  fi.kv_dtype = o.backend == "cpu" ? "f32" : "bf16";
  fi.numerics = lb.backend->name();
  k.fingerprint = uf::server::kv_fingerprint(fi);
  return k;
}

// Builds the engine that serves requests: the StubEngine for HTTP-path tests, else the model on
// the chosen backend behind the generation loop, warmed up before /readyz turns 200.
std::shared_ptr<uf::server::GenerationEngine> make_engine(
    const ServeOptions& o, const uf::tokenizer::ChatEncoder& encoder) {
  if (o.stub_engine) {
    auto cfg = uf::server::stub_config_for(encoder);
    cfg.step_delay_us = o.stub_step_delay_us;
    cfg.tokens_per_step_max = o.stub_max_accept;
    cfg.content_tokens_min = 200;
    cfg.content_tokens_max = 6000;
    if (!o.server.served_model_name.empty()) cfg.model_name = o.server.served_model_name;
    return std::make_shared<uf::server::StubEngine>(std::move(cfg));
  }
  UF_CHECK(!o.model.empty(), "--model is required (or --stub-engine)");
  uf::cli::BackendChoice choice{o.backend, false};
  choice.tp = o.tp;
  o.cuda.apply(choice);
  choice.max_seq = o.server.max_seq;
  auto loaded = uf::cli::load_backend(o.model, choice);
  uf::server::ModelEngineOptions mo;
  mo.model_name = o.server.served_model_name.empty()
                      ? std::filesystem::path(o.model).filename().string()
                      : o.server.served_model_name;
  mo.max_seq = o.server.max_seq;
  mo.host_cache_bytes = o.host_cache_bytes;
  mo.mode = o.no_spec ? uf::engine::DecodeMode::kPlain : uf::engine::DecodeMode::kSpeculative;
  mo.verify =
      o.verify == "token" ? uf::sampling::VerifyMode::kTokenWise : uf::sampling::VerifyMode::kBlock;
  mo.draft_tokens = o.draft_tokens;
  mo.sharing = kv_sharing_options(o, loaded);
  spdlog::info("decoding: {} ({} verification), profile: {} drafts, confidence threshold {} ({})",
               o.no_spec ? "plain" : "speculative", o.verify,
               o.draft_tokens ? o.draft_tokens : loaded.profile.draft_tokens,
               loaded.profile.confidence_threshold, loaded.profile.note);
  auto engine =
      std::make_shared<uf::server::ModelEngine>(std::move(loaded.backend), loaded.profile, mo);
  engine->warm_up(encoder.bos_id());
  return engine;
}

// --generation-config: the model's sampling defaults for the parameters a request leaves out.
void set_sampling_defaults(ServeOptions& o) {
  std::string path = o.generation_config;
  if (path == "none") {
    path.clear();
  } else if (path == "auto") {
    const auto candidate = std::filesystem::path(o.model) / "generation_config.json";
    path = !o.model.empty() && std::filesystem::exists(candidate) ? candidate.string() : "";
  }
  if (!path.empty()) o.server.parser.default_sampling = uf::server::load_sampling_defaults(path);
  spdlog::info("sampling defaults for omitted parameters: {} ({})",
               uf::server::describe_sampling(o.server.parser.default_sampling),
               path.empty() ? std::string("OpenAI's") : path);
}

int run_serve(ServeOptions o) {
  UF_CHECK(o.backend == "cpu" || o.backend == "cuda", "--backend must be cpu or cuda, got '{}'",
           o.backend);
  if (o.tokenizer.empty()) {
    UF_CHECK(!o.model.empty(), "--model (or --tokenizer with --stub-engine) is required");
    o.tokenizer = (std::filesystem::path(o.model) / "tokenizer.json").string();
  }
  UF_CHECK(std::filesystem::exists(o.tokenizer), "tokenizer file {} does not exist", o.tokenizer);
  set_sampling_defaults(o);

  // Signals go to a dedicated thread (sigwait), never interrupting server threads.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  uf::server::HttpServer server(o.server);
  const int port = server.bind();
  o.bound_port = port;
  spdlog::info("listening on http://{}:{} (loading the model; /readyz answers 503 until ready)",
               o.server.host, port);
  std::thread http([&] { server.serve(); });
  std::thread signals([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    spdlog::info("signal {} received; stopping", sig);
    server.stop();
  });

  try {
    auto t0 = std::chrono::steady_clock::now();
    auto encoder = std::make_shared<const uf::tokenizer::ChatEncoder>(
        uf::tokenizer::Tokenizer::from_file(o.tokenizer));
    spdlog::info("tokenizer {} loaded ({} ids)", o.tokenizer, encoder->tokenizer().vocab_size());
    auto engine = make_engine(o, *encoder);
    server.set_model(std::move(engine), std::move(encoder));
    server.set_ready(true);
    spdlog::info("ready after {:.2f} s: model '{}', max-seq {}, max-queue {}",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 server.config().served_model_name, o.server.max_seq, o.server.max_queue);
  } catch (...) {
    pthread_kill(signals.native_handle(), SIGTERM);  // wakes sigwait, which stops the server
    signals.join();
    http.join();
    throw;
  }
  http.join();
  signals.join();
  return 0;
}

void setup_serve(CLI::App& app, int& exit_code) {
  auto opts = std::make_shared<ServeOptions>();
  auto* cmd = app.add_subcommand("serve", "Serve the model over an OpenAI-compatible HTTP API");
  auto& s = opts->server;
  cmd->add_option("--model", opts->model, "Model directory (config, checkpoint, tokenizer.json)");
  cmd->add_option("--tokenizer", opts->tokenizer,
                  "tokenizer.json (default: <model>/tokenizer.json)");
  cmd->add_option("--backend", opts->backend, "Compute backend: cpu or cuda")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--tp", opts->tp, "Tensor-parallel GPUs for --backend cuda (devices 0..N-1)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--host", s.host, "Address to listen on (0.0.0.0 for all interfaces)")
      ->capture_default_str();
  cmd->add_option("--port", s.port, "TCP port to listen on (0 picks a free one)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--max-seq", s.max_seq, "Maximum tokens per request, prompt plus completion")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 21));
  cmd->add_option("--max-queue", s.max_queue,
                  "Requests that may wait for the engine; more get HTTP 429 with Retry-After")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-prepared", s.max_prepared,
                  "Queued requests the preparation thread readies ahead of their turn")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--max-body-bytes", s.max_body_bytes,
                  "Largest accepted request body; larger ones get HTTP 413")
      ->capture_default_str();
  cmd->add_option("--read-timeout", s.read_timeout_s,
                  "Seconds a client may stall while sending its request")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600));
  cmd->add_option("--write-timeout", s.write_timeout_s,
                  "Seconds a client may stall while receiving its response")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600));
  cmd->add_option("--keep-alive-timeout", s.keep_alive_timeout_s,
                  "Seconds an idle keep-alive connection stays open")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600));
  cmd->add_option("--http-threads", s.http_threads,
                  "HTTP worker threads (0: max-queue + 16; each waiting request holds one)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--served-model-name", s.served_model_name,
                  "Model id in /v1/models and responses (default: the engine's name)");
  cmd->add_option("--generation-config", opts->generation_config,
                  "Sampling defaults (temperature, top_p, top_k) for what a request leaves out: "
                  "auto (<model>/generation_config.json if present), none (OpenAI's: 1, 1, off), "
                  "or a generation_config.json path")
      ->capture_default_str();
  uf::cli::add_cuda_switches(cmd, opts->cuda);
  cmd->add_flag("--no-spec", opts->no_spec,
                "Plain decoding: one token per step, no DSpark drafting");
  cmd->add_option("--verify", opts->verify,
                  "Draft verification: block (Sun et al. 2024) or token (token-wise rejection)")
      ->capture_default_str()
      ->check(CLI::IsMember({"block", "token"}));
  cmd->add_option("--draft-tokens", opts->draft_tokens,
                  "Draft tokens per step, 1..7 (0: the hardware profile's value)")
      ->capture_default_str()
      ->check(CLI::Range(0, 7));
  cmd->add_option("--host-cache-bytes", opts->host_cache_bytes,
                  "Host memory for conversations' KV snapshots (LRU), in bytes")
      ->capture_default_str();
  cmd->add_option("--redis", opts->redis,
                  "KV sharing: the Redis session directory, HOST:PORT (absent: no sharing "
                  "between servers)");
  cmd->add_option("--kv-listen", opts->kv_listen,
                  "KV sharing: UCX listener other servers fetch snapshots from, HOST:PORT "
                  "(0.0.0.0 for all interfaces; port 0 picks one)");
  cmd->add_option("--kv-advertise", opts->kv_advertise,
                  "KV sharing: the host other servers connect to (default: the --kv-listen host)");
  cmd->add_option("--server-id", opts->server_id,
                  "KV sharing: this server's unique id in the directory (default: hostname:port)");
  cmd->add_option("--kv-fetch-timeout-ms", opts->kv_fetch_timeout_ms,
                  "KV sharing: deadline of one remote snapshot fetch; past it the prompt is "
                  "recomputed")
      ->capture_default_str()
      ->check(CLI::Range(1, 600000));
  cmd->add_option("--kv-published-bytes", opts->kv_published_bytes,
                  "KV sharing: registered host memory for snapshots offered to other servers "
                  "(LRU; 0: same as --host-cache-bytes)")
      ->capture_default_str();
  cmd->add_flag("--stub-engine", opts->stub_engine,
                "Serve the StubEngine (no model: seeded shuffled-English tokens) for testing the "
                "HTTP path");
  cmd->add_option("--stub-step-delay-us", opts->stub_step_delay_us,
                  "StubEngine: microseconds per verify step")
      ->capture_default_str()
      ->check(CLI::Range(0, 10000000));
  cmd->add_option("--stub-max-accept", opts->stub_max_accept,
                  "StubEngine: most tokens per verify step (1..8)")
      ->capture_default_str()
      ->check(CLI::Range(1, 8));
  cmd->callback([opts, &exit_code] { exit_code = run_serve(*opts); });
}

}  // namespace

UF_REGISTER_COMMAND("serve", setup_serve);
