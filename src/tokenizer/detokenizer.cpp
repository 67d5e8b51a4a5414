#include "tokenizer/detokenizer.h"

#include "tokenizer/unicode.h"

namespace {
constexpr std::string_view kToolCallsStart = "\n\n<｜DSML｜ calls";
}  // namespace

namespace uf::tokenizer {

StreamingDetokenizer::StreamingDetokenizer(Tokenizer tokenizer, DetokenizerOptions options)
    : tok_(std::move(tokenizer)), opts_(std::move(options)) {
  think_start_ = tok_.token_to_id("<think>").value_or(-1);
  think_end_ = tok_.token_to_id("</think>").value_or(-1);
  dsml_ = tok_.token_to_id("｜DSML｜").value_or(-1);
  in_reasoning_ = opts_.thinking;
  std::erase_if(opts_.stop, [](const std::string& s) { return s.empty(); });
}

void StreamingDetokenizer::emit(std::string_view text, bool final, DetokenizerChunk& out) {
  if (in_tool_calls_) {
    tool_text_.append(text);
    return;
  }
  std::string& dest = in_reasoning_ ? out.reasoning : out.content;
  std::string& all = in_reasoning_ ? all_reasoning_ : all_content_;
  // Markers: stop strings (content, or reasoning too if asked) and the tool-call block start.
  const bool use_stops = !in_reasoning_ || opts_.stop_in_reasoning;
  const bool use_tools = !in_reasoning_ && opts_.detect_tool_calls;
  if ((!use_stops || opts_.stop.empty()) && !use_tools) {
    dest.append(text);
    all.append(text);
    return;
  }
  held_.append(text);
  auto for_each_marker = [&](auto&& fn) {
    if (use_stops) {
      for (const auto& s : opts_.stop) fn(std::string_view(s), false);
    }
    if (use_tools) fn(std::string_view(kToolCallsStart), true);
  };
  // The earliest complete marker wins.
  size_t first = std::string::npos;
  std::string_view which;
  bool is_tool = false;
  for_each_marker([&](std::string_view m, bool tool) {
    size_t p = held_.find(m);
    if (p < first) {
      first = p;
      which = m;
      is_tool = tool;
    }
  });
  if (first != std::string::npos) {
    dest.append(held_, 0, first);
    all.append(held_, 0, first);
    if (is_tool) {
      in_tool_calls_ = true;
      out.tool_calls_started = true;
      tool_text_ = held_.substr(first);
    } else {
      stopped_ = true;
      out.stopped = true;
      out.stop_string = std::string(which);
    }
    held_.clear();
    return;
  }
  // Hold back the longest tail that could still grow into a marker.
  size_t hold = 0;
  if (!final) {
    for_each_marker([&](std::string_view m, bool) {
      for (size_t len = std::min(m.size() - 1, held_.size()); len > hold; --len) {
        if (held_.compare(held_.size() - len, len, m.data(), len) == 0) {
          hold = len;
          break;
        }
      }
    });
  }
  size_t release = held_.size() - hold;
  dest.append(held_, 0, release);
  all.append(held_, 0, release);
  held_.erase(0, release);
}

DetokenizerChunk StreamingDetokenizer::push(int32_t id) {
  DetokenizerChunk out;
  if (stopped_) return out;
  if (id == think_end_ || id == think_start_) {
    // </think> ends the reasoning; <think> only opens it. Neither is text.
    if (id == think_end_ && in_reasoning_) {
      std::string rest = utf8_lossy(pending_bytes_);
      pending_bytes_.clear();
      emit(rest, /*final=*/true, out);
      if (stopped_) return out;
      in_reasoning_ = false;
    }
    return out;
  }
  if (opts_.skip_special_tokens && tok_.is_special(id) && id != dsml_) return out;
  if (tok_.joins_with_spaces() && any_text_token_) pending_bytes_.push_back(' ');
  any_text_token_ = true;
  tok_.append_token_bytes(id, pending_bytes_);
  size_t keep = incomplete_utf8_suffix(pending_bytes_);
  std::string text =
      utf8_lossy(std::string_view(pending_bytes_).substr(0, pending_bytes_.size() - keep));
  pending_bytes_.erase(0, pending_bytes_.size() - keep);
  emit(text, /*final=*/false, out);
  return out;
}

DetokenizerChunk StreamingDetokenizer::finish() {
  DetokenizerChunk out;
  if (stopped_) return out;
  std::string rest = utf8_lossy(pending_bytes_);  // an incomplete character becomes U+FFFD
  pending_bytes_.clear();
  emit(rest, /*final=*/true, out);
  return out;
}

}  // namespace uf::tokenizer
