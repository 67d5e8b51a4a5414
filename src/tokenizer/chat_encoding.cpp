// DeepSeek-V4.1 prompt rendering, following encoding/encoding.py step by step: image/content-block
// preprocessing, merge_tool_messages, sort_tool_results_by_call_order, _drop_thinking_messages,
// render_message. Comments name the reference function each part mirrors.
#include "tokenizer/chat_encoding.h"

#include <algorithm>
#include <map>
#include <optional>

#include "core/error.h"

namespace uf::tokenizer {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";
constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
constexpr std::string_view kThinkStart = "<think>";
constexpr std::string_view kThinkEnd = "</think>";
constexpr std::string_view kDsml = "｜DSML｜";
constexpr std::string_view kUser = "<｜User｜>";
constexpr std::string_view kAssistant = "<｜Assistant｜>";
constexpr std::string_view kSystem = "<｜System｜>";
constexpr std::string_view kLatestReminder = "<｜latest_reminder｜>";
constexpr std::string_view kImage = "<｜deepseek_image｜>";

const std::string kCallsOpen = "<｜DSML｜ calls>";
const std::string kCallsClose = "</｜DSML｜ calls>";
const std::string kInvoke = "<｜DSML｜ invoke";
const std::string kInvokeClose = "</｜DSML｜ invoke";
const std::string kParam = "<｜DSML｜ parameter";
const std::string kParamClose = "/｜DSML｜ parameter";  // as the reference parser splits it
const std::string kToolCallsStart = "\n\n<｜DSML｜ calls";

constexpr std::string_view kReasoningEffortTemplate =
    "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n";

// TOOLS_TEMPLATE with the V4.1 tag names substituted.
constexpr std::string_view kToolsTemplate =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    "by writing a \"<｜DSML｜ calls>\" block like the following:\n\n"
    "<｜DSML｜ calls>\n"
    "<｜DSML｜ invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜ parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜ "
    "parameter>\n"
    "...\n"
    "</｜DSML｜ invoke>\n"
    "<｜DSML｜ invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types "
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    "`string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n";

struct Block {
  std::string type;
  std::string text;         // type "text"
  std::string tool_use_id;  // type "tool_result"
  std::string content;      // type "tool_result"
};

struct Message {
  std::string role;
  std::string content;
  std::optional<std::string> reasoning;
  bool has_blocks = false;  // "content_blocks" present (every user message after merging)
  std::vector<Block> blocks;
  ojson tool_calls;       // OpenAI tool_calls array (assistant), or null
  ojson tools;            // function definitions (first message), or null
  ojson response_format;  // or null
  std::string tool_call_id;
};

std::string where(size_t i) { return fmt::format("messages[{}]", i); }

const std::string& get_string(const ojson& v, const std::string& what) {
  UF_CHECK(v.is_string(), "{} must be a string", what);
  return v.get_ref<const std::string&>();
}

// process_image_messages + _validate_no_image_sp_tokens, without vision support.
Message read_message(const ojson& m, size_t i) {
  UF_CHECK(m.is_object(), "{} must be an object", where(i));
  UF_CHECK(m.contains("role"), "{} has no role", where(i));
  Message msg;
  msg.role = get_string(m.at("role"), where(i) + ".role");
  static const char* kRoles[] = {"system", "user", "assistant", "tool", "latest_reminder"};
  UF_CHECK(std::find(std::begin(kRoles), std::end(kRoles), msg.role) != std::end(kRoles),
           "{} has unknown role '{}' (expected system, user, assistant, tool or latest_reminder)",
           where(i), msg.role);
  if (m.contains("content") && !m.at("content").is_null()) {
    const ojson& c = m.at("content");
    if (c.is_string()) {
      msg.content = c.get<std::string>();
      UF_CHECK(msg.content.find(kImage) == std::string::npos,
               "{}.content contains the image token '{}'; images are not supported", where(i),
               kImage);
    } else if (c.is_array()) {
      std::vector<std::string> texts;
      for (size_t k = 0; k < c.size(); ++k) {
        const ojson& b = c[k];
        std::string bw = fmt::format("{}.content[{}]", where(i), k);
        UF_CHECK(b.is_object() && b.contains("type"), "{} must be an object with a type", bw);
        Block block;
        block.type = get_string(b.at("type"), bw + ".type");
        UF_CHECK(block.type != "image" && block.type != "image_url",
                 "{} is an image; this server does not accept images", bw);
        if (block.type == "text") {
          block.text = b.contains("text") && !b.at("text").is_null()
                           ? get_string(b.at("text"), bw + ".text")
                           : std::string();
          UF_CHECK(block.text.find(kImage) == std::string::npos, "{} contains the image token '{}'",
                   bw, kImage);
          texts.push_back(block.text);
        }
        msg.blocks.push_back(std::move(block));
      }
      msg.has_blocks = !msg.blocks.empty();
      for (size_t k = 0; k < texts.size(); ++k) msg.content += (k ? "\n\n" : "") + texts[k];
    } else {
      core::fail("{}.content must be a string, an array of content parts or null", where(i));
    }
  }
  if (m.contains("reasoning_content") && !m.at("reasoning_content").is_null()) {
    msg.reasoning = get_string(m.at("reasoning_content"), where(i) + ".reasoning_content");
    UF_CHECK(msg.reasoning->find(kImage) == std::string::npos,
             "{}.reasoning_content contains the image token", where(i));
  }
  if (m.contains("tool_calls") && !m.at("tool_calls").is_null()) {
    UF_CHECK(msg.role == "assistant", "{} has tool_calls but is not an assistant message",
             where(i));
    const ojson& tc = m.at("tool_calls");
    UF_CHECK(tc.is_array(), "{}.tool_calls must be an array", where(i));
    for (size_t k = 0; k < tc.size(); ++k) {
      std::string tw = fmt::format("{}.tool_calls[{}]", where(i), k);
      UF_CHECK(tc[k].is_object() && tc[k].contains("function") && tc[k]["function"].is_object(),
               "{} must be an object with a function", tw);
      UF_CHECK(tc[k]["function"].contains("name"), "{}.function has no name", tw);
      get_string(tc[k]["function"]["name"], tw + ".function.name");
    }
    msg.tool_calls = tc;
  }
  if (m.contains("tool_call_id") && m.at("tool_call_id").is_string()) {
    msg.tool_call_id = m.at("tool_call_id").get<std::string>();
  }
  return msg;
}

// merge_tool_messages: tool results become tool_result blocks of a user message; consecutive
// user messages merge into one.
std::vector<Message> merge_tool_messages(std::vector<Message> in) {
  std::vector<Message> out;
  for (auto& msg : in) {
    if (msg.role == "tool") {
      Block b{"tool_result", "", msg.tool_call_id, msg.content};
      if (!out.empty() && out.back().role == "user" && out.back().has_blocks) {
        out.back().blocks.push_back(std::move(b));
      } else {
        Message u;
        u.role = "user";
        u.has_blocks = true;
        u.blocks.push_back(std::move(b));
        out.push_back(std::move(u));
      }
    } else if (msg.role == "user") {
      if (!msg.has_blocks) msg.blocks = {Block{"text", msg.content, "", ""}};
      // Content given as an empty array keeps no blocks (renders as empty text).
      if (!out.empty() && out.back().role == "user" && out.back().has_blocks) {
        for (auto& b : msg.blocks) out.back().blocks.push_back(std::move(b));
      } else {
        msg.has_blocks = true;
        out.push_back(std::move(msg));
      }
    } else {
      out.push_back(std::move(msg));
    }
  }
  return out;
}

// sort_tool_results_by_call_order (a stable sort, unknown ids ranking as 0).
void sort_tool_results(std::vector<Message>& msgs) {
  std::map<std::string, int> order;
  for (auto& msg : msgs) {
    if (msg.role == "assistant" && msg.tool_calls.is_array() && !msg.tool_calls.empty()) {
      order.clear();
      for (size_t k = 0; k < msg.tool_calls.size(); ++k) {
        const ojson& tc = msg.tool_calls[k];
        std::string id;
        if (tc.contains("id") && tc["id"].is_string()) id = tc["id"].get<std::string>();
        if (id.empty() && tc["function"].contains("id") && tc["function"]["id"].is_string()) {
          id = tc["function"]["id"].get<std::string>();
        }
        if (!id.empty()) order[id] = int(k);
      }
    } else if (msg.role == "user" && msg.has_blocks) {
      std::vector<Block> tools;
      for (auto& b : msg.blocks) {
        if (b.type == "tool_result") tools.push_back(b);
      }
      if (tools.size() > 1 && !order.empty()) {
        auto key = [&](const Block& b) {
          auto it = order.find(b.tool_use_id);
          return it == order.end() ? 0 : it->second;
        };
        std::stable_sort(tools.begin(), tools.end(),
                         [&](const Block& a, const Block& b) { return key(a) < key(b); });
        size_t t = 0;
        for (auto& b : msg.blocks) {
          if (b.type == "tool_result") b = tools[t++];
        }
      }
    }
  }
}

// find_last_user_index: mid-conversation system messages count as user messages.
int last_user_index(const std::vector<Message>& msgs) {
  for (int i = int(msgs.size()) - 1; i >= 0; --i) {
    if (msgs[size_t(i)].role == "user" || (msgs[size_t(i)].role == "system" && i > 0)) return i;
  }
  return -1;
}

void dump_string(const std::string& s, std::string& out) {
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out.push_back(char(c));
        }
    }
  }
  out.push_back('"');
}

void dump(const ojson& v, std::string& out) {
  switch (v.type()) {
    case ojson::value_t::object: {
      out.push_back('{');
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (!first) out += ", ";
        first = false;
        dump_string(it.key(), out);
        out += ": ";
        dump(it.value(), out);
      }
      out.push_back('}');
      break;
    }
    case ojson::value_t::array: {
      out.push_back('[');
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += ", ";
        dump(v[i], out);
      }
      out.push_back(']');
      break;
    }
    case ojson::value_t::string:
      dump_string(v.get_ref<const std::string&>(), out);
      break;
    default:
      out += v.dump();  // numbers, booleans, null: same spelling as Python's
  }
}

// encode_arguments_to_dsml
std::string arguments_to_dsml(const ojson& function) {
  ojson args =
      function.contains("arguments") ? function.at("arguments") : ojson(ojson::value_t::object);
  const ojson original = args;
  for (int k = 0; k < 2 && args.is_string(); ++k) {
    // Tolerates JSON strings, including double-encoded ones.
    ojson parsed = ojson::parse(args.get<std::string>(), nullptr, false);
    if (parsed.is_discarded()) break;
    args = std::move(parsed);
  }
  if (!args.is_object()) args = ojson{{"arguments", original}};
  std::string out;
  bool first = true;
  for (auto it = args.begin(); it != args.end(); ++it) {
    if (!first) out += "\n";
    first = false;
    bool is_str = it.value().is_string();
    out += fmt::format("<｜DSML｜ parameter name=\"{}\" string=\"{}\">", it.key(),
                       is_str ? "true" : "false");
    out += is_str ? it.value().get<std::string>() : python_json_dumps(it.value());
    out += "</｜DSML｜ parameter>";
  }
  return out;
}

int reasoning_effort_value(const ojson& request) {
  if (!request.contains("reasoning_effort") || request.at("reasoning_effort").is_null()) return 75;
  const ojson& e = request.at("reasoning_effort");
  if (e.is_number_integer()) {
    int64_t v = e.get<int64_t>();
    UF_CHECK(v >= 1 && v <= 100, "reasoning_effort {} is out of range 1..100", v);
    return int(v);
  }
  UF_CHECK(e.is_string(), "reasoning_effort must be a string or an integer in 1..100");
  const std::string& s = e.get_ref<const std::string&>();
  if (s == "low") return 50;
  if (s == "medium" || s == "high" || s == "none") return 75;
  if (s == "max") return 100;
  core::fail("reasoning_effort '{}' is not one of low, medium, high, max, none or 1..100", s);
}

bool thinking_enabled(const ojson& request) {
  bool thinking = true;
  if (request.contains("thinking") && !request.at("thinking").is_null()) {
    const ojson& t = request.at("thinking");
    if (t.is_boolean()) {
      thinking = t.get<bool>();
    } else {
      UF_CHECK(t.is_object() && t.contains("type") && t["type"].is_string(),
               "thinking must be {{\"type\": \"enabled\"}} or {{\"type\": \"disabled\"}}");
      const std::string& type = t["type"].get_ref<const std::string&>();
      UF_CHECK(type == "enabled" || type == "disabled",
               "thinking.type '{}' is neither 'enabled' nor 'disabled'", type);
      thinking = type == "enabled";
    }
  }
  if (request.contains("chat_template_kwargs") && request["chat_template_kwargs"].is_object() &&
      request["chat_template_kwargs"].contains("thinking")) {
    const ojson& t = request["chat_template_kwargs"]["thinking"];
    UF_CHECK(t.is_boolean(), "chat_template_kwargs.thinking must be a boolean");
    thinking = t.get<bool>();
  }
  if (request.contains("reasoning_effort") && request["reasoning_effort"] == "none")
    thinking = false;
  return thinking;
}

// render_message
std::string render_message(size_t index, const std::vector<Message>& msgs, bool thinking,
                           bool drop_thinking, int effort) {
  const Message& msg = msgs[index];
  const int last_user = last_user_index(msgs);
  std::string prompt;
  const bool effort_prompt = index == 0 && thinking;
  if (index == 0 && (effort_prompt || msg.role == "system")) prompt += kSystem;
  if (effort_prompt) prompt += fmt::format(kReasoningEffortTemplate, effort);

  if (msg.role == "system") {
    if (index > 0) prompt += kSystem;
    prompt += msg.content;
    if (msg.tools.is_array() && !msg.tools.empty()) {
      std::string schemas;
      for (size_t k = 0; k < msg.tools.size(); ++k) {
        if (k) schemas += "\n";
        schemas += python_json_dumps(msg.tools[k]);
      }
      prompt += "\n\n" + fmt::format(kToolsTemplate, schemas);
    }
    if (!msg.response_format.is_null()) {
      prompt +=
          "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to "
          "reply:\n" +
          python_json_dumps(msg.response_format);
    }
  } else if (msg.role == "user") {
    prompt += kUser;
    if (msg.has_blocks && !msg.blocks.empty()) {
      for (size_t k = 0; k < msg.blocks.size(); ++k) {
        const Block& b = msg.blocks[k];
        if (k) prompt += "\n\n";
        if (b.type == "text") {
          prompt += b.text;
        } else if (b.type == "tool_result") {
          prompt += "<tool_result>" + b.content + "</tool_result>";
        } else {
          prompt += "[Unsupported " + b.type + "]";
        }
      }
    } else {
      prompt += msg.content;
    }
  } else if (msg.role == "latest_reminder") {
    prompt += std::string(kLatestReminder) + msg.content;
  } else if (msg.role == "assistant") {
    std::string calls;
    if (msg.tool_calls.is_array() && !msg.tool_calls.empty()) {
      std::string list;
      for (size_t k = 0; k < msg.tool_calls.size(); ++k) {
        const ojson& f = msg.tool_calls[k]["function"];
        if (k) list += "\n";
        list += fmt::format("<｜DSML｜ invoke name=\"{}\">\n{}\n</｜DSML｜ invoke>",
                            f["name"].get<std::string>(), arguments_to_dsml(f));
      }
      calls = "\n\n" + kCallsOpen + "\n" + list + "\n" + kCallsClose;
    }
    std::string thinking_part;
    if (thinking && (!drop_thinking || int(index) > last_user)) {
      thinking_part = msg.reasoning.value_or("") + std::string(kThinkEnd);
    }
    prompt += thinking_part + msg.content + calls + std::string(kEos);
  }

  // The generation header follows the last user (or mid-conversation system) message of a run.
  if (index + 1 < msgs.size() && msgs[index + 1].role != "assistant" &&
      msgs[index + 1].role != "latest_reminder") {
    return prompt;
  }
  if (msg.role == "user" || (msg.role == "system" && index > 0)) {
    prompt += kAssistant;
    bool open = thinking && (!drop_thinking || int(index) >= last_user);
    prompt += open ? kThinkStart : kThinkEnd;
  }
  return prompt;
}

}  // namespace

std::string python_json_dumps(const nlohmann::ordered_json& value) {
  std::string out;
  dump(value, out);
  return out;
}

ChatEncoder::ChatEncoder(Tokenizer tokenizer, ChatLimits limits)
    : tok_(std::move(tokenizer)), limits_(limits) {
  // Every special token the format writes must exist as one token in this tokenizer. The ones
  // only some requests need (latest_reminder, DSML) are checked when a request needs them.
  for (std::string_view s : {kUser, kAssistant, kSystem}) tok_.require_token_id(s);
  bos_ = tok_.require_token_id(kBos);
  eos_ = tok_.require_token_id(kEos);
  think_start_ = tok_.require_token_id(kThinkStart);
  think_end_ = tok_.require_token_id(kThinkEnd);
}

std::string ChatEncoder::render(const nlohmann::ordered_json& request, bool* thinking_out) const {
  UF_CHECK(request.is_object(), "the chat request must be a JSON object");
  UF_CHECK(request.contains("messages") && request["messages"].is_array(),
           "the chat request has no 'messages' array");
  const ojson& raw = request["messages"];
  UF_CHECK(!raw.empty(), "the chat request's 'messages' array is empty");
  UF_CHECK(raw.size() <= limits_.max_messages, "the chat request has {} messages, more than {}",
           raw.size(), limits_.max_messages);
  const bool thinking = thinking_enabled(request);
  const int effort = reasoning_effort_value(request);
  if (thinking_out) *thinking_out = thinking;

  std::vector<Message> msgs;
  msgs.reserve(raw.size() + 1);
  for (size_t i = 0; i < raw.size(); ++i) msgs.push_back(read_message(raw[i], i));

  // Request-level tools and response_format go to the first message (load_cases), which must be a
  // system message for them to be rendered.
  ojson tools = ojson::array();
  if (request.contains("tools") && !request["tools"].is_null()) {
    const ojson& t = request["tools"];
    UF_CHECK(t.is_array(), "'tools' must be an array");
    for (size_t k = 0; k < t.size(); ++k) {
      UF_CHECK(t[k].is_object() && t[k].contains("function") && t[k]["function"].is_object(),
               "tools[{}] must be an object with a 'function' object", k);
      tools.push_back(t[k]["function"]);  // tools_from_openai_format
    }
  }
  ojson response_format;
  if (request.contains("response_format") && request["response_format"].is_object() &&
      request["response_format"].value("type", "") != "text") {
    response_format = request["response_format"];
  }
  if ((!tools.empty() || !response_format.is_null()) && msgs[0].role != "system") {
    Message sys;
    sys.role = "system";
    msgs.insert(msgs.begin(), std::move(sys));
  }
  if (!tools.empty()) msgs[0].tools = tools;
  if (!response_format.is_null()) msgs[0].response_format = response_format;

  for (const auto& m : msgs) {
    if (m.role == "latest_reminder") tok_.require_token_id(kLatestReminder);
    if (!m.tool_calls.is_null() || !m.tools.is_null()) tok_.require_token_id(kDsml);
  }

  msgs = merge_tool_messages(std::move(msgs));
  sort_tool_results(msgs);

  // Reasoning of assistant turns before the last user message is dropped unless tools are present.
  const bool drop_thinking = tools.empty();
  if (thinking && drop_thinking) {
    const int last_user = last_user_index(msgs);
    for (int i = 0; i < last_user; ++i) {
      if (msgs[size_t(i)].role == "assistant") msgs[size_t(i)].reasoning.reset();
    }
  }

  std::string prompt(kBos);
  for (size_t i = 0; i < msgs.size(); ++i) {
    prompt += render_message(i, msgs, thinking, drop_thinking, effort);
    UF_CHECK(prompt.size() <= limits_.max_prompt_bytes,
             "the rendered prompt exceeds {} bytes (at message {})", limits_.max_prompt_bytes, i);
  }
  return prompt;
}

ChatPrompt ChatEncoder::encode(const nlohmann::ordered_json& request) const {
  ChatPrompt p;
  p.text = render(request, &p.thinking);
  p.ids = tok_.encode(p.text);
  return p;
}

ChatPrompt ChatEncoder::encode(const nlohmann::json& request) const {
  return encode(nlohmann::ordered_json::parse(request.dump()));
}

ChatPrompt ChatEncoder::encode_body(std::string_view json_text) const {
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    core::fail("the chat request is not valid JSON: {}", e.what());
  }
  return encode(j);
}

// ---- Parsing generated text (parse_message_from_completion_text, parse_tool_calls) ----

namespace {

// _read_until_stop: the text from `index` to the earliest stop string; index moves past it.
std::string_view read_until(std::string_view text, size_t& index,
                            std::initializer_list<std::string_view> stops,
                            std::string_view* matched) {
  size_t best = std::string_view::npos;
  std::string_view which;
  for (auto s : stops) {
    size_t p = text.find(s, index);
    if (p != std::string_view::npos && p < best) {
      best = p;
      which = s;
    }
  }
  std::string_view content;
  if (best == std::string_view::npos) {
    content = text.substr(index);
    index = text.size();
    *matched = {};
  } else {
    content = text.substr(index, best - index);
    index = best + which.size();
    *matched = which;
  }
  return content;
}

std::vector<ParsedToolCall> parse_tool_calls(std::string_view text, size_t& index) {
  std::vector<ParsedToolCall> calls;
  std::string_view stop;
  while (index < text.size()) {
    std::string_view gap = read_until(text, index, {kInvoke, kCallsClose}, &stop);
    UF_CHECK(gap == ">\n", "tool call format error: expected '>\\n' but got '{}'", gap);
    if (stop == kCallsClose) break;
    UF_CHECK(!stop.empty(), "tool call format error: the DSML calls block is not closed");
    std::string_view head = read_until(text, index, {kParam, kInvokeClose}, &stop);
    // ^\s*name="(.*?)">\n$ in Python, where $ also matches before one final newline (so a call
    // without parameters, "...">\n\n</｜DSML｜ invoke", parses).
    size_t k = 0;
    while (k < head.size() &&
           (head[k] == ' ' || head[k] == '\t' || head[k] == '\n' || head[k] == '\r'))
      ++k;
    std::string_view body = head.substr(std::min(k, head.size()));
    if (body.size() >= 4 && body.substr(body.size() - 4) == "\">\n\n") body.remove_suffix(1);
    UF_CHECK(body.substr(0, 6) == "name=\"" && body.size() >= 9 &&
                 body.substr(body.size() - 3) == "\">\n",
             "tool name format error: '{}'", head);
    ParsedToolCall call;
    call.name = std::string(body.substr(6, body.size() - 9));
    std::vector<std::string> names;
    std::string args = "{";
    while (stop == kParam) {
      std::string_view p = read_until(text, index, {kParamClose}, &stop);
      // ^ name="(.*?)" string="(true|false)">(.*?)<$
      UF_CHECK(p.substr(0, 7) == " name=\"" && !p.empty() && p.back() == '<',
               "parameter format error: '{}'", p);
      size_t t = p.find("\" string=\"true\">", 7), f = p.find("\" string=\"false\">", 7);
      bool is_str = t != std::string_view::npos && (f == std::string_view::npos || t < f);
      size_t end_name = is_str ? t : f;
      UF_CHECK(end_name != std::string_view::npos, "parameter format error: '{}'", p);
      std::string name(p.substr(7, end_name - 7));
      size_t value_start = end_name + (is_str ? 16 : 17);
      UF_CHECK(value_start <= p.size() - 1, "parameter format error: '{}'", p);
      std::string value(p.substr(value_start, p.size() - 1 - value_start));
      UF_CHECK(std::find(names.begin(), names.end(), name) == names.end(),
               "duplicate parameter name '{}' in tool call '{}'", name, call.name);
      names.push_back(name);
      if (names.size() > 1) args += ", ";
      args += python_json_dumps(name) + ": " + (is_str ? python_json_dumps(value) : value);
      std::string_view after = read_until(text, index, {kParam, kInvokeClose}, &stop);
      UF_CHECK(after == ">\n", "parameter format error: expected '>\\n' but got '{}'", after);
    }
    args += "}";
    call.arguments = std::move(args);
    calls.push_back(std::move(call));
  }
  return calls;
}

}  // namespace

size_t find_tool_calls_start(std::string_view text) { return text.find(kToolCallsStart); }

ParsedAssistantMessage parse_assistant_output(std::string_view text, bool thinking) {
  ParsedAssistantMessage out;
  size_t index = 0;
  std::string_view stop;
  if (thinking) {
    std::string_view r = read_until(text, index, {kThinkEnd, kToolCallsStart}, &stop);
    UF_CHECK(stop != kToolCallsStart, "invalid thinking format: a tool call before </think>");
    out.reasoning_content = std::string(r);
    if (stop.empty()) return out;  // stopped while still reasoning
  }
  std::string_view c = read_until(text, index, {kEos, kToolCallsStart}, &stop);
  out.content = std::string(c);
  if (stop == kToolCallsStart) {
    out.tool_calls = parse_tool_calls(text, index);
    std::string_view rest = read_until(text, index, {kEos}, &stop);
    UF_CHECK(rest.empty(), "unexpected text after the tool calls: '{}'", rest);
  }
  UF_CHECK(index == text.size(), "unexpected text after the end of the message");
  return out;
}

}  // namespace uf::tokenizer
