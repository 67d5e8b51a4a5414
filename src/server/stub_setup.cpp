#include "server/stub_setup.h"

#include <algorithm>

namespace uf::server {

StubEngineConfig stub_config_for(const tokenizer::ChatEncoder& encoder) {
  static const char* kText =
      "The engine thread decodes one request at a time while the preparation thread readies the "
      "next ones. Each verify step commits between one and eight tokens, and the server streams "
      "them to the client as soon as they arrive. A block of drafted tokens is checked against "
      "the target model, so the output keeps exactly the distribution of plain decoding. "
      "Tetris pieces fall into a grid of ten columns; full rows vanish and the score grows.";
  const auto& tok = encoder.tokenizer();
  std::vector<int32_t> ids = tok.encode(kText);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  ids.erase(std::remove_if(ids.begin(), ids.end(), [&](int32_t id) { return tok.is_added(id); }),
            ids.end());
  StubEngineConfig c;
  c.vocabulary = std::move(ids);
  c.think_start_id = encoder.think_start_id();
  c.think_end_id = encoder.think_end_id();
  c.eos_id = encoder.eos_id();
  return c;
}

}  // namespace uf::server
