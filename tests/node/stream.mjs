// One streamed answer read by a real Node SDK: `node stream.mjs openai|anthropic BASE_URL KEY
// MODEL [HEADERS_JSON]`. Prints what the SDK parsed, as JSON: the text, the events and the
// usage, so the test can compare it with the stream the proxy relayed (an SDK that choked on
// the proxy's closing comment line would throw, or parse something else).
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";

const [sdk, baseURL, apiKey, model, headersJson] = process.argv.slice(2);
const headers = headersJson ? JSON.parse(headersJson) : {};
const out = { text: "", events: 0, usage: null };

if (sdk === "openai") {
  const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
  const stream = await client.chat.completions.create(
    { model, messages: [{ role: "user", content: "count to three" }], stream: true,
      stream_options: { include_usage: true } },
    { headers });
  for await (const chunk of stream) {
    out.events += 1;
    out.text += chunk.choices[0]?.delta?.content ?? "";
    if (chunk.usage) out.usage = chunk.usage;
  }
} else {
  const client = new Anthropic({ baseURL, apiKey, maxRetries: 0 });
  const stream = client.messages.stream(
    { model, max_tokens: 64, messages: [{ role: "user", content: "count to three" }] },
    { headers });
  stream.on("streamEvent", () => { out.events += 1; });
  const message = await stream.finalMessage();
  out.text = message.content.map((b) => b.text ?? "").join("");
  out.usage = message.usage;
}
process.stdout.write(JSON.stringify(out));
