// A three-turn conversation through the AI SDK's default OpenAI provider (the Responses API, store: true: it
// refers to earlier output items by id), a function tool called in the second turn. Prints, for each request,
// its prompt tokens, the tokens read from cache, the items it sent and the agent program kvgate ran it in; fails
// unless every request after the first reads at least 80% of the previous prompt from cache, in one program.
// Run from a folder with `npm install ai @ai-sdk/openai zod` (ES modules resolve from the script's folder: copy
// it there): node aisdk_conversation.mjs http://127.0.0.1:PORT
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, stepCountIs, tool } from 'ai';
import { z } from 'zod';

const base = process.argv[2] ?? 'http://127.0.0.1:8000';
const sent = []; // each request's input items, and the agent program kvgate ran it in
const recorded = async (url, init) => {
  const answer = await fetch(url, init);
  const items = JSON.parse(init.body).input.map((i) => i.type ?? i.role);
  sent.push({ items, program: answer.headers.get('x-kvgate-program-id') });
  return answer;
};
const provider = createOpenAI({ baseURL: `${base}/v1`, apiKey: 'x', fetch: recorded });
const model = provider(process.env.KVGATE_MODEL ?? 'SmolLM2-135M-Instruct');
const getWeather = tool({
  description: 'The weather in a city.',
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => `Sunny in ${city}, 22 C.`,
});
const asked = ['Name a city in France.', 'What is the weather there?', 'And tomorrow?'];
const messages = [];
const requests = [];
for (const [turn, question] of asked.entries()) {
  messages.push({ role: 'user', content: question });
  const called = turn === 1; // the second turn calls the tool first, then answers
  const result = await generateText({
    model,
    system: 'You answer in one short sentence.',
    messages,
    tools: { getWeather },
    temperature: 0,
    maxOutputTokens: called ? 48 : 12,
    stopWhen: stepCountIs(called ? 2 : 1),
    prepareStep: ({ stepNumber }) => ({ toolChoice: called && stepNumber === 0 ? 'required' : 'none' }),
    providerOptions: { openai: { parallelToolCalls: false } }, // one call: a 135M model goes on calling
  });
  messages.push(...result.response.messages);
  for (const step of result.steps) {
    const prompt = step.usage.inputTokens;
    const cached = step.usage.inputTokenDetails?.cacheReadTokens ?? step.usage.cachedInputTokens ?? 0;
    const last = requests.at(-1);
    const share = last ? (cached / last.prompt).toFixed(2) : '-';
    requests.push({ turn: turn + 1, prompt, cached, share, calls: step.toolCalls.length, ...sent[requests.length] });
    console.log(JSON.stringify({ ...requests.at(-1), text: step.text, openai: step.providerMetadata?.openai }));
  }
}
const low = requests.slice(1).filter((r) => Number(r.share) < 0.8);
const programs = new Set(requests.map((r) => r.program)).size;
const failed = low.length > 0 || programs !== 1;
console.log(failed ? `FAIL: ${low.length} requests read < 80% of the previous prompt; ${programs} programs` : 'OK');
process.exit(failed ? 1 : 0);
