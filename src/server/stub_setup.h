#pragma once
// A StubEngine configuration that matches a real tokenizer: its vocabulary is the tokens of a
// short English text (so stub output reads as shuffled English words), and its think/EOS ids come
// from the chat encoder. Used by `ultrafast serve --stub-engine`, the tests and the benchmark.

#include "server/stub_engine.h"
#include "tokenizer/chat_encoding.h"

namespace uf::server {

StubEngineConfig stub_config_for(const tokenizer::ChatEncoder& encoder);

}  // namespace uf::server
