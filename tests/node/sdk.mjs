// The OpenAI Node SDK, unchanged, against the api: what tests/unit/test_node_sdk.py asserts is printed as
// one JSON object. Usage: node sdk.mjs <base url of /lmsp/v1> <token> <model>
import OpenAI from "openai";

const [baseURL, apiKey, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const out = {};

async function caught(call) {
  try {
    await call();
    return null;
  } catch (e) {
    return { name: e.constructor.name, status: e.status, message: e.message, code: e.code, param: e.param,
             type: e.type };
  }
}

out.missing = await caught(() => client.responses.retrieve("resp_" + "0".repeat(26)));
out.bad = await caught(() => client.responses.create({ model, input: "hi", max_output_tokens: -1 }));
out.unknown = await caught(() => new OpenAI({ baseURL, apiKey: "not-a-token", maxRetries: 0 }).models.list());

// The stream helper: its accumulator reads every event (it throws on one it cannot place), and its
// listeners fire on the events OpenAI's API sends.
const input = [{ role: "user", content: "hi" }];
const stream = client.responses.stream({ model, input, store: true });
out.types = [];
out.textDone = null;
stream.on("event", (event) => out.types.push(event.type));
stream.on("response.output_text.done", (event) => { out.textDone = event.text; });
const final = await stream.finalResponse();
out.final = { id: final.id, output_text: final.output_text, output: final.output };
out.retrieved = (await client.responses.retrieve(final.id)).output_text;

// What the helper returned, sent back as the next turn's history (it added `parsed` to the text part).
const next = await caught(() => client.responses.create(
  { model, input: [...input, ...final.output, { role: "user", content: "More." }], store: true }));
out.history = next;
console.log(JSON.stringify(out));
