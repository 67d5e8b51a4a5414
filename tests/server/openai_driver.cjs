// Drives a running ultrafast server with the official `openai` npm client.
// Usage: node openai_driver.cjs <fast base URL> <slow base URL> <npm dir>
// The fast server runs the StubEngine at full speed; the slow one emits one token per millisecond
// without end (for cancellation). Exits non-zero if any scenario fails; prints one line each.
'use strict';
const path = require('path');
const assert = require('assert/strict');
const [fastURL, slowURL, npmDir] = process.argv.slice(2);
const OpenAI = require(path.join(npmDir, 'node_modules', 'openai'));

const fast = new OpenAI({ baseURL: fastURL + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 30000 });
const slow = new OpenAI({ baseURL: slowURL + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 30000 });
const MODEL = 'deepseek-v4.1-flash';
const TOOL_MARKER = '[[call-weather]]';
const STOP_MARKER = '[[say-stop]]';
const user = (text) => [{ role: 'user', content: text }];
const tools = [{
  type: 'function',
  function: {
    name: 'get_weather', description: 'Weather forecast for a city',
    parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } } },
  },
}];

async function collect(stream) {
  const out = { chunks: [], reasoning: '', content: '', finish: null, usage: null, toolCalls: [] };
  for await (const chunk of stream) {
    out.chunks.push(chunk);
    if (chunk.usage) out.usage = chunk.usage;
    for (const ch of chunk.choices) {
      if (ch.delta.reasoning_content) out.reasoning += ch.delta.reasoning_content;
      if (ch.delta.content) out.content += ch.delta.content;
      if (ch.delta.tool_calls) out.toolCalls.push(...ch.delta.tool_calls);
      if (ch.finish_reason) out.finish = ch.finish_reason;
    }
  }
  return out;
}

async function metric(base, series) {
  const text = await (await fetch(base + '/metrics')).text();
  for (const line of text.split('\n')) {
    if (line.startsWith(series + ' ')) return Number(line.slice(series.length + 1));
  }
  return -1;
}

const scenarios = {
  async nonStreaming() {
    const r = await fast.chat.completions.create({ model: MODEL, messages: user('Hello'), seed: 1 });
    assert.equal(r.object, 'chat.completion');
    assert.equal(r.choices[0].finish_reason, 'stop');
    assert.ok(r.choices[0].message.content.length > 0);
    assert.ok(r.choices[0].message.reasoning_content.length > 0, 'thinking is on by default');
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
    assert.ok(r.usage.completion_tokens_details.reasoning_tokens > 0);
  },
  async streamingMatchesNonStreamingWithUsage() {
    const body = { model: MODEL, messages: user('Hello'), seed: 77 };
    const whole = await fast.chat.completions.create(body);
    const s = await collect(await fast.chat.completions.create(
      { ...body, stream: true, stream_options: { include_usage: true } }));
    assert.equal(s.content, whole.choices[0].message.content);
    assert.equal(s.reasoning, whole.choices[0].message.reasoning_content);
    assert.equal(s.finish, 'stop');
    const first = s.chunks[0];
    assert.equal(first.choices[0].delta.role, 'assistant');
    for (const c of s.chunks) {
      assert.equal(c.object, 'chat.completion.chunk');
      assert.equal(c.id, first.id);
    }
    const last = s.chunks[s.chunks.length - 1];
    assert.deepEqual(last.choices, []);
    assert.deepEqual(last.usage, whole.usage);
    for (const c of s.chunks.slice(0, -1)) assert.equal(c.usage, null);
    // Without include_usage no usage chunk is sent.
    const n = await collect(await fast.chat.completions.create({ ...body, stream: true }));
    assert.equal(n.usage, null);
    assert.equal(n.content, s.content);
  },
  async stopStrings() {
    const body = { model: MODEL, messages: user('go ' + STOP_MARKER), stop: ['STOP'],
                   thinking: { type: 'disabled' } };
    const r = await fast.chat.completions.create(body);
    assert.equal(r.choices[0].message.content, 'alpha beta gamma ');
    assert.equal(r.choices[0].finish_reason, 'stop');
    const s = await collect(await fast.chat.completions.create({ ...body, stream: true }));
    assert.equal(s.content, 'alpha beta gamma ');
    assert.equal(s.finish, 'stop');
  },
  async maxTokens() {
    const r = await fast.chat.completions.create({ model: MODEL, messages: user('Hi'), max_tokens: 7 });
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.usage.completion_tokens, 7);
    const m = await fast.chat.completions.create(
      { model: MODEL, messages: user('Hi'), max_completion_tokens: 4, stream: true,
        stream_options: { include_usage: true } });
    const s = await collect(m);
    assert.equal(s.finish, 'length');
    assert.equal(s.usage.completion_tokens, 4);
  },
  async thinkingOnOff() {
    const off = await fast.chat.completions.create(
      { model: MODEL, messages: user('Hi'), thinking: { type: 'disabled' }, seed: 5 });
    assert.equal(off.choices[0].message.reasoning_content, undefined);
    assert.equal(off.usage.completion_tokens_details.reasoning_tokens, 0);
    const offStream = await collect(await fast.chat.completions.create(
      { model: MODEL, messages: user('Hi'), thinking: { type: 'disabled' }, seed: 5, stream: true }));
    assert.equal(offStream.reasoning, '');
    assert.equal(offStream.content, off.choices[0].message.content);
    const on = await collect(await fast.chat.completions.create(
      { model: MODEL, messages: user('Hi'), thinking: { type: 'enabled' }, seed: 5, stream: true }));
    assert.ok(on.reasoning.length > 0);
    assert.ok(on.content.length > 0);
  },
  async seedReproducibility() {
    const body = { model: MODEL, messages: user('Tell me something'), seed: 1234 };
    const a = await fast.chat.completions.create(body);
    const b = await fast.chat.completions.create(body);
    const c = await fast.chat.completions.create({ ...body, seed: 1235 });
    assert.equal(a.choices[0].message.content, b.choices[0].message.content);
    assert.notEqual(a.choices[0].message.content, c.choices[0].message.content);
  },
  async toolCallsRoundTrip() {
    const messages = user('What is the weather in Paris? ' + TOOL_MARKER);
    const r = await fast.chat.completions.create({ model: MODEL, messages, tools });
    const msg = r.choices[0].message;
    assert.equal(r.choices[0].finish_reason, 'tool_calls');
    assert.equal(msg.content, 'Let me check the weather.');
    assert.equal(msg.tool_calls.length, 1);
    const call = msg.tool_calls[0];
    assert.equal(call.type, 'function');
    assert.equal(call.function.name, 'get_weather');
    assert.deepEqual(JSON.parse(call.function.arguments), { city: 'Paris', days: 3 });
    assert.ok(call.id.startsWith('call_'));
    // Streaming: the DSML block never leaks into content; the call arrives as a tool_calls delta.
    const s = await collect(await fast.chat.completions.create({ model: MODEL, messages, tools, stream: true }));
    assert.equal(s.content, 'Let me check the weather.');
    assert.ok(!s.content.includes('DSML'));
    assert.equal(s.finish, 'tool_calls');
    assert.equal(s.toolCalls.length, 1);
    assert.equal(s.toolCalls[0].function.name, 'get_weather');
    assert.deepEqual(JSON.parse(s.toolCalls[0].function.arguments), { city: 'Paris', days: 3 });
    // Second turn with the tool result: needs the session header, then answers normally.
    const turn2 = [...messages, msg, { role: 'tool', tool_call_id: call.id, content: '{"temp": 21}' }];
    await assert.rejects(fast.chat.completions.create({ model: MODEL, messages: turn2, tools }),
      (e) => e.status === 400 && e.code === 'missing_session_id');
    const r2 = await fast.chat.completions.create({ model: MODEL, messages: turn2, tools },
      { headers: { 'X-Session-ID': 'weather-chat' } });
    assert.equal(r2.choices[0].finish_reason, 'stop');
    assert.ok(r2.choices[0].message.content.length > 0);
  },
  async cancellationMidStream() {
    const before = await metric(slowURL, 'uf_requests_total{outcome="cancelled"}');
    const ac = new AbortController();
    const stream = await slow.chat.completions.create(
      { model: MODEL, messages: user('forever'), max_tokens: 100000, stream: true },
      { signal: ac.signal });
    let n = 0;
    try {
      // The SDK may end the iteration quietly or throw an AbortError; either way the socket closes.
      for await (const _ of stream) { if (++n === 10) ac.abort(); }
    } catch (e) {
      if (e.name !== 'AbortError' && !(e instanceof OpenAI.APIUserAbortError)) throw e;
    }
    assert.ok(n >= 10 && n < 1000, `read ${n} chunks before the abort took effect`);
    let after = -1;
    for (let i = 0; i < 200 && after !== Math.max(before, 0) + 1; ++i) {
      await new Promise((r) => setTimeout(r, 10));
      after = await metric(slowURL, 'uf_requests_total{outcome="cancelled"}');
    }
    assert.equal(after, Math.max(before, 0) + 1, 'the server saw the cancellation');
    assert.equal(await metric(slowURL, 'uf_running_requests'), 0);
    const ok = await slow.chat.completions.create({ model: MODEL, messages: user('short'), max_tokens: 3 });
    assert.equal(ok.usage.completion_tokens, 3);
  },
  async concurrentClients() {
    const seeds = Array.from({ length: 16 }, (_, i) => 500 + i);
    const expected = [];
    for (const seed of seeds) {
      const r = await fast.chat.completions.create({ model: MODEL, messages: user('Hi'), seed });
      expected.push(r.choices[0].message);
    }
    const results = await Promise.all(seeds.map(async (seed) =>
      collect(await fast.chat.completions.create(
        { model: MODEL, messages: user('Hi'), seed, stream: true, stream_options: { include_usage: true } }))));
    results.forEach((s, i) => {
      assert.equal(s.content, expected[i].content, `client ${i} content`);
      assert.equal(s.reasoning, expected[i].reasoning_content, `client ${i} reasoning`);
      assert.equal(s.finish, 'stop');
      assert.ok(s.usage.completion_tokens > 0);
    });
    assert.equal(new Set(results.map((s) => s.content)).size, 16, 'distinct seeds, distinct outputs');
  },
  async errorsThroughClient() {
    await assert.rejects(fast.chat.completions.create({ model: MODEL, messages: user('x'), temperature: 5 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'temperature' && e.type === 'invalid_request_error');
    await assert.rejects(fast.chat.completions.create({ model: MODEL, messages: [] }),
      (e) => e.status === 400);
    await assert.rejects(fast.models.retrieve('no-such-model'), (e) => e instanceof OpenAI.NotFoundError);
  },
  async completionsAndModels() {
    const c = await fast.completions.create({ model: MODEL, prompt: 'Once upon a time', max_tokens: 6 });
    assert.equal(c.object, 'text_completion');
    assert.equal(c.usage.completion_tokens, 6);
    const s = await fast.completions.create({ model: MODEL, prompt: 'Once', max_tokens: 6, stream: true, seed: 2 });
    let text = '';
    for await (const chunk of s) text += chunk.choices[0]?.text ?? '';
    assert.ok(text.length > 0);
    const models = await fast.models.list();
    assert.equal(models.data[0].id, MODEL);
  },
};

(async () => {
  let failed = 0;
  for (const [name, fn] of Object.entries(scenarios)) {
    try {
      await fn();
      console.log(`PASS ${name}`);
    } catch (e) {
      failed++;
      console.log(`FAIL ${name}: ${e && e.stack ? e.stack : e}`);
    }
  }
  console.log(failed ? `${failed} scenario(s) failed` : 'all scenarios passed');
  process.exit(failed ? 1 : 0);
})();
