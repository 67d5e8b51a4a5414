// `ultrafast tokenize`: the tokenizer from the command line.
//   ultrafast tokenize --tokenizer tokenizer.json < text.txt      -> JSON array of ids
//   ultrafast tokenize --tokenizer tokenizer.json --decode < ids.json -> text
//   ultrafast tokenize --tokenizer tokenizer.json --chat < request.json -> prompt ids
#include <cstdio>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "cli/command_registry.h"
#include "core/error.h"
#include "tokenizer/chat_encoding.h"
#include "tokenizer/tokenizer.h"

namespace {

struct TokenizeOptions {
  std::string tokenizer;
  bool decode = false;
  bool chat = false;
  bool render = false;
  bool skip_special = false;
};

// Reads all of stdin, refusing more than `limit` bytes (bounded memory).
std::string read_stdin(size_t limit) {
  std::string data;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, stdin)) > 0) {
    data.append(buf, n);
    UF_CHECK(data.size() <= limit, "stdin is larger than the limit of {} bytes", limit);
  }
  return data;
}

int run_tokenize(const TokenizeOptions& o) {
  using uf::tokenizer::Tokenizer;
  UF_CHECK(!(o.decode && o.chat), "--decode and --chat cannot be combined");
  Tokenizer tok = Tokenizer::from_file(o.tokenizer);
  std::string input = read_stdin(Tokenizer::max_input_bytes());
  if (o.decode) {
    nlohmann::json ids;
    try {
      ids = nlohmann::json::parse(input);
    } catch (const nlohmann::json::exception& e) {
      uf::core::fail("--decode expects a JSON array of token ids on stdin: {}", e.what());
    }
    UF_CHECK(ids.is_array(), "--decode expects a JSON array of token ids on stdin");
    std::vector<int32_t> v;
    v.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      UF_CHECK(ids[i].is_number_integer(), "element {} of the id array is not an integer", i);
      int64_t id = ids[i].get<int64_t>();
      UF_CHECK(id >= 0 && id < tok.vocab_size(), "element {} ({}) is not a token id of {}", i, id,
               o.tokenizer);
      v.push_back(int32_t(id));
    }
    std::string text = tok.decode(v, o.skip_special);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  if (o.chat) {
    uf::tokenizer::ChatEncoder enc(tok);
    auto prompt = enc.encode_body(input);
    if (o.render) {
      std::fwrite(prompt.text.data(), 1, prompt.text.size(), stdout);
    } else {
      std::printf("%s\n", nlohmann::json(prompt.ids).dump().c_str());
    }
    return 0;
  }
  std::printf("%s\n", nlohmann::json(tok.encode(input)).dump().c_str());
  return 0;
}

void setup_tokenize(CLI::App& app, int& exit_code) {
  auto opts = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand("tokenize",
                                     "Encode UTF-8 text from stdin to token ids (JSON array), or "
                                     "decode, or encode a chat request");
  cmd->add_option("--tokenizer", opts->tokenizer, "Path to a Hugging Face tokenizer.json")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_flag("--decode", opts->decode, "Read a JSON array of ids from stdin and print the text");
  cmd->add_flag("--chat", opts->chat,
                "Read an OpenAI-style chat request (messages, thinking, tools) and print the "
                "DeepSeek-V4.1 prompt ids");
  cmd->add_flag("--render", opts->render, "With --chat: print the rendered prompt text instead");
  cmd->add_flag("--skip-special", opts->skip_special, "With --decode: leave out special tokens");
  cmd->callback([opts, &exit_code] { exit_code = run_tokenize(*opts); });
}

}  // namespace

UF_REGISTER_COMMAND("tokenize", setup_tokenize);
