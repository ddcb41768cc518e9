// The Vercel AI SDK's default OpenAI provider against kvgate: `node aisdk_conversation.mjs BASE_URL MODEL API_KEY`.
// Its provider speaks /v1/responses with store: true, and refers to earlier output items by id (item_reference).
// A three-turn conversation, a function tool called in the second turn; prints one JSON object: each request's
// prompt tokens, the tokens it read from cache, the input items it sent and the agent program kvgate ran it in
// (or the conversation's error), for tests/frameworks/test_node_clients.py to assert on.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, stepCountIs, tool } from "ai";
import { z } from "zod";

const [baseURL, modelName, apiKey] = process.argv.slice(2);
const sent = []; // each request's input items, and the program it ran in
const recorded = async (url, init) => {
  const answer = await fetch(url, init);
  const items = JSON.parse(init.body).input.map((i) => i.type ?? i.role);
  sent.push({ items, program: answer.headers.get("x-kvgate-program-id") });
  return answer;
};
const model = createOpenAI({ baseURL: `${baseURL}/v1`, apiKey, fetch: recorded })(modelName);
const getWeather = tool({
  description: "The weather in a city.",
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => `Sunny in ${city}, 22 C.`,
});

async function conversation() {
  const messages = [];
  const requests = [];
  for (const [turn, question] of ["Name a city in France.", "What is the weather there?", "And tomorrow?"].entries()) {
    messages.push({ role: "user", content: question });
    const called = turn === 1; // the second turn calls the tool first, then answers
    const result = await generateText({
      model,
      system: "You answer in one short sentence.",
      messages,
      tools: { getWeather },
      temperature: 0,
      maxRetries: 0,
      maxOutputTokens: called ? 48 : 12,
      stopWhen: stepCountIs(called ? 2 : 1),
      prepareStep: ({ stepNumber }) => ({ toolChoice: called && stepNumber === 0 ? "required" : "none" }),
      providerOptions: { openai: { parallelToolCalls: false } }, // one call: a 135M model goes on calling
    });
    messages.push(...result.response.messages);
    for (const step of result.steps) {
      const cached = step.usage.inputTokenDetails?.cacheReadTokens ?? step.usage.cachedInputTokens ?? 0;
      const calls = step.toolCalls.map((c) => ({ name: c.toolName, input: c.input }));
      requests.push({ turn: turn + 1, prompt: step.usage.inputTokens, cached, calls, ...sent[requests.length] });
    }
  }
  return { requests };
}

let result;
try {
  result = await conversation();
} catch (err) {
  result = { failed: `${err.constructor.name}: ${err.message}` };
}
console.log(JSON.stringify({ conversation: result }));
