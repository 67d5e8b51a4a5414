#include "server/output_assembler.h"

#include <array>
#include <string_view>

#include "core/log.h"

namespace uf::server {
namespace {

// How a DSML tool-call block starts in the content text: with the ｜DSML｜ marker as text, or with
// it removed when a tokenizer lists it as a skipped special token.
constexpr std::array<std::string_view, 2> kToolBlockStarts = {"\n\n<｜DSML｜ calls", "\n\n< calls"};

// The earliest position from which the rest of `s` could still grow into a tool-block start.
size_t possible_block_start(const std::string& s) {
  size_t longest = 0;
  for (auto m : kToolBlockStarts) longest = std::max(longest, m.size());
  size_t from = s.size() > longest ? s.size() - longest : 0;
  for (size_t p = from; p < s.size(); ++p) {
    std::string_view tail(s.data() + p, s.size() - p);
    for (auto m : kToolBlockStarts) {
      if (m.substr(0, tail.size()) == tail) return p;
    }
  }
  return s.size();
}

}  // namespace

OutputAssembler::OutputAssembler(const tokenizer::Tokenizer& tok, bool thinking,
                                 std::vector<std::string> stop, bool tools,
                                 std::string call_id_prefix)
    : tok_(tok),
      detok_(tok, tokenizer::DetokenizerOptions{thinking, std::move(stop), false, true}),
      thinking_(thinking),
      tools_(tools),
      call_id_prefix_(std::move(call_id_prefix)) {}

void OutputAssembler::take(const tokenizer::DetokenizerChunk& c, OutputDelta& out) {
  out.reasoning += c.reasoning;
  if (tools_) {
    held_content_ += c.content;
  } else {
    out.content += c.content;
  }
}

OutputDelta OutputAssembler::push(std::span<const int32_t> ids) {
  OutputDelta out;
  for (int32_t id : ids) {
    if (detok_.stopped()) break;
    ++completion_tokens_;
    if (thinking_ && detok_.in_reasoning()) ++reasoning_tokens_;
    if (tools_) tok_.append_token_bytes(id, raw_);
    take(detok_.push(id), out);
    // Tool calls live in the content part; DSML inside the reasoning is not a call.
    if (tools_ && scan_from_ == std::string::npos && !detok_.in_reasoning()) {
      scan_from_ = raw_.size();
    }
  }
  if (tools_ && !in_tool_block_ && scan_from_ != std::string::npos) {
    // Only the new tail (plus a marker's length of overlap) needs scanning: linear overall.
    constexpr size_t kOverlap = 64;
    const size_t begin = std::max(scan_from_, scanned_to_ > kOverlap ? scanned_to_ - kOverlap : 0);
    if (tokenizer::find_tool_calls_start(std::string_view(raw_).substr(begin)) !=
        std::string::npos) {
      in_tool_block_ = true;
    }
    scanned_to_ = raw_.size();
  }
  release_content(out, false);
  return out;
}

void OutputAssembler::release_content(OutputDelta& out, bool final) {
  if (!tools_ || held_content_.empty()) return;
  if (in_tool_block_) {
    // Everything from the block start on is DSML; the text before it is ordinary content.
    size_t pos = std::string::npos;
    for (auto m : kToolBlockStarts) pos = std::min(pos, held_content_.find(m));
    if (pos != std::string::npos) {
      out.content += held_content_.substr(0, pos);
      held_content_.erase(0, pos);
    }
    return;  // the rest stays held: dropped when the calls parse, shown if they do not
  }
  size_t keep = final ? held_content_.size() : possible_block_start(held_content_);
  out.content += held_content_.substr(0, keep);
  held_content_.erase(0, keep);
}

OutputDelta OutputAssembler::finish() {
  OutputDelta out;
  take(detok_.finish(), out);
  if (!tools_) return out;
  if (in_tool_block_) {
    release_content(out, false);
    try {
      auto parsed = tokenizer::parse_assistant_output(raw_, thinking_);
      for (size_t i = 0; i < parsed.tool_calls.size(); ++i) {
        tool_calls_.push_back({call_id_prefix_ + std::to_string(i), parsed.tool_calls[i].name,
                               parsed.tool_calls[i].arguments});
      }
      held_content_.clear();
    } catch (const std::exception& e) {
      // A malformed block is shown to the client as text rather than dropped.
      spdlog::warn("tool-call block did not parse ({}); returning it as content", e.what());
    }
  }
  out.content += held_content_;
  held_content_.clear();
  return out;
}

}  // namespace uf::server
