// The openai Node SDK against kvgate: `node openai_client.mjs BASE_URL MODEL API_KEY` prints one JSON object,
// a result per step (or the step's error), for tests/frameworks/test_node_clients.py to assert on.
import OpenAI from "openai";

const [baseURL, model, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey, maxRetries: 0, timeout: 120_000 });
const SYSTEM = "You answer in one short sentence.";
const GREEDY = { model, temperature: 0 };
const WEATHER = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Get the weather for a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};

const usageOf = (u) => ({
  prompt_tokens: u?.prompt_tokens,
  completion_tokens: u?.completion_tokens,
  cached_tokens: u?.prompt_tokens_details?.cached_tokens,
});

async function create(body) {
  const { data, response } = await client.chat.completions.create(body).withResponse();
  const [choice] = data.choices;
  return {
    id: data.id,
    object: data.object,
    content: choice.message.content,
    finish_reason: choice.finish_reason,
    tool_calls: choice.message.tool_calls ?? null,
    message: choice.message,
    usage: usageOf(data.usage),
    reused_header: Number(response.headers.get("x-kvgate-reused-tokens")),
  };
}

// A conversation: turn 2 resends turn 1 and its answer, and kvgate reads their KV (cached_tokens).
async function conversation() {
  const history = [{ role: "system", content: SYSTEM }, { role: "user", content: "What is the capital of France?" }];
  const first = await create({ ...GREEDY, messages: history, max_tokens: 8 });
  history.push({ role: "assistant", content: first.content }, { role: "user", content: "And of Italy?" });
  const second = await create({ ...GREEDY, messages: history, max_tokens: 8 });
  return { first, second };
}

// The same first turn streamed: chunks, the text they add up to, and usage in the last chunk.
async function stream() {
  const messages = [{ role: "system", content: SYSTEM }, { role: "user", content: "What is the capital of France?" }];
  const chunks = await client.chat.completions.create({
    ...GREEDY, messages, max_tokens: 8, stream: true, stream_options: { include_usage: true },
  });
  let content = "", finish_reason = null, usage = null, count = 0, object = null;
  for await (const chunk of chunks) {
    count += 1;
    object = chunk.object;
    for (const choice of chunk.choices) {
      content += choice.delta?.content ?? "";
      finish_reason = choice.finish_reason ?? finish_reason;
    }
    if (chunk.usage) usage = usageOf(chunk.usage);
  }
  return { content, finish_reason, usage, chunks: count, object };
}

// A forced tool call, the tool's result sent back, and the model's answer.
async function toolCall() {
  const messages = [{ role: "system", content: SYSTEM }, { role: "user", content: "What is the weather in Paris?" }];
  const tools = { tools: [WEATHER], max_tokens: 40 };
  const first = await create({ ...GREEDY, ...tools, messages, tool_choice: "required", parallel_tool_calls: false });
  const call = first.tool_calls?.[0];
  const args = JSON.parse(call.function.arguments);
  messages.push(first.message, { role: "tool", tool_call_id: call.id, content: `Sunny and 21 degrees in ${args.city}.` });
  const second = await create({ ...GREEDY, ...tools, messages, max_tokens: 8 });
  return { first, arguments: args, second };
}

// An unknown model: the SDK's own error class, from OpenAI's error shape.
async function unknownModel() {
  try {
    await client.chat.completions.create({ model: "no-such-model", messages: [{ role: "user", content: "Hi" }] });
    return { raised: null };
  } catch (err) {
    return { raised: err.constructor.name, status: err.status, error: err.error ?? null };
  }
}

const steps = { conversation, stream, tool_call: toolCall, unknown_model: unknownModel };
const results = {};
for (const [name, step] of Object.entries(steps)) {
  try {
    results[name] = await step();
  } catch (err) {
    results[name] = { failed: `${err.constructor.name}: ${err.message}` };
  }
}
console.log(JSON.stringify(results));
