// The Anthropic TypeScript SDK against kvgate's /v1/messages and /v1/models: `node anthropic_client.mjs BASE_URL
// MODEL API_KEY` prints one JSON object, a result per step (or the step's error), for
// tests/frameworks/test_node_clients.py to assert on.
import Anthropic from "@anthropic-ai/sdk";

const [baseURL, model, apiKey] = process.argv.slice(2);
const client = new Anthropic({ baseURL, apiKey, maxRetries: 0, timeout: 120_000 });
const REQUEST = {
  model,
  max_tokens: 8,
  temperature: 0,
  system: "You answer in one short sentence.",
  messages: [{ role: "user", content: "What is the capital of Spain?" }],
};

async function create() {
  const message = await client.messages.create(REQUEST);
  return message;
}

// The same request streamed: the event types in order, and the message the SDK builds from them.
async function stream() {
  const events = [];
  const running = client.messages.stream(REQUEST);
  for await (const event of running) events.push(event.type);
  return { events, message: await running.finalMessage() };
}

// A page of one at a time, paged through by the SDK (after_id = last_id while has_more), and one model by id.
async function models() {
  const page = await client.models.list();
  const paged = [];
  for await (const info of client.models.list({ limit: 1 })) paged.push(info.id);
  const first = await client.models.list({ limit: 1 });
  const retrieved = await client.models.retrieve(model);
  return {
    data: page.data,
    has_more: page.has_more,
    paged,
    first_page: { ids: first.data.map((m) => m.id), has_more: first.has_more, first_id: first.first_id, last_id: first.last_id },
    retrieved,
  };
}

// An unknown model: the SDK's own error class, from Anthropic's error shape.
async function unknownModel() {
  try {
    await client.messages.create({ ...REQUEST, model: "no-such-model" });
    return { raised: null };
  } catch (err) {
    return { raised: err.constructor.name, status: err.status, error: err.error ?? null };
  }
}

const steps = { create, stream, models, unknown_model: unknownModel };
const results = {};
for (const [name, step] of Object.entries(steps)) {
  try {
    results[name] = await step();
  } catch (err) {
    results[name] = { failed: `${err.constructor.name}: ${err.message}` };
  }
}
console.log(JSON.stringify(results));
