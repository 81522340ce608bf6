// The official TypeScript SDK client against a shmcancel MCP server (the example) on the
// streamable HTTP transport (2025-11-25 wire). Run by tools/peers.sh:
//   node ts_client.mjs http://127.0.0.1:PORT/mcp
// Prints one JSON line per check ({"check", "ok", "detail"}); exits 0 when all passed.
//
// What matters here (contract §5): the SDK turns an HTTP 4xx into a StreamableHTTPError (and fires
// the transport's onerror), so every request it can send must come back as 200 carrying either
// an MCP error (McpError) or a result; a cancelled call must stop on the server.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { McpError } from "@modelcontextprotocol/sdk/types.js";

const url = new URL(process.argv[2] ?? "http://127.0.0.1:8000/mcp");
const DEADLINE_MS = 10_000;
const results = [];
const transportErrors = [];
const clientErrors = [];
const sleepReplies = []; // {id, status, body, at}: what the server answered the long sleep's POST
const LONG_SLEEP = 30;

// ok: true / false; "note" for an observation that is not a failure of the server (not counted).
function report(check, ok, detail = "") {
  results.push({ check, ok });
  console.log(JSON.stringify({ check, ok, detail: String(detail).slice(0, 400) }));
}

// Records the server's reply to each tools/call sleep, even one the SDK no longer waits for.
async function tracingFetch(input, init) {
  const res = await fetch(input, init);
  let msg = null;
  try {
    msg = typeof init?.body === "string" ? JSON.parse(init.body) : null;
  } catch {
    msg = null;
  }
  if (msg?.method === "tools/call" && msg.params?.arguments?.seconds === LONG_SLEEP) {
    res.clone().text().then(
      (body) => sleepReplies.push({ id: msg.id, status: res.status, body, at: Date.now() }),
      (e) => sleepReplies.push({ id: msg.id, status: res.status, body: `unread: ${e}`, at: Date.now() }),
    );
  }
  return res;
}

function describe(e) {
  return `${e?.constructor?.name}: ${e?.message} (code ${e?.code})`;
}

async function expectMcpError(check, promise, code) {
  try {
    const r = await promise;
    report(check, false, `no error; result ${JSON.stringify(r)}`);
  } catch (e) {
    const ok = e instanceof McpError && e.code === code;
    report(check, ok, ok ? `McpError ${e.code}: ${e.message}` : `expected McpError ${code}, got ${describe(e)}`);
  }
}

async function expectToolError(check, promise, needle) {
  try {
    const r = await promise;
    const text = r?.content?.[0]?.text ?? "";
    const ok = r?.isError === true && text.includes(needle);
    report(check, ok, ok ? `isError: ${text}` : `expected isError naming ${needle}, got ${JSON.stringify(r)}`);
  } catch (e) {
    report(check, false, `expected a result with isError, got ${describe(e)}`);
  }
}

async function waitFor(pred, ms) {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (pred()) return true;
    await new Promise((r) => setTimeout(r, 20));
  }
  return pred();
}

const transport = new StreamableHTTPClientTransport(url, { fetch: tracingFetch });
transport.onerror = (e) => transportErrors.push(describe(e));
const client = new Client({ name: "shmcancel-peers-ts", version: "1.0.0" });
client.onerror = (e) => clientErrors.push(describe(e));

try {
  await client.connect(transport);
  report("initialize", true, `server ${JSON.stringify(client.getServerVersion())}, protocol ${transport.protocolVersion ?? "?"}, session ${transport.sessionId ? "yes" : "no"}`);
} catch (e) {
  report("initialize", false, describe(e));
  process.exit(1);
}

try {
  const { tools } = await client.listTools();
  const names = tools.map((t) => t.name).sort();
  report("tools/list", names.includes("echo") && names.includes("sleep"), names.join(","));
} catch (e) {
  report("tools/list", false, describe(e));
}

try {
  const r = await client.callTool({ name: "echo", arguments: { text: "héllo" } });
  const ok = r.isError !== true && r.content?.[0]?.text === "héllo";
  report("echo", ok, JSON.stringify(r));
} catch (e) {
  report("echo", false, describe(e));
}

await expectMcpError("unknown tool -> McpError -32602", client.callTool({ name: "no_such_tool", arguments: {} }), -32602);
await expectToolError("echo bad arguments -> isError", client.callTool({ name: "echo", arguments: { text: 5 } }), "text");
await expectToolError("sleep bad seconds -> isError", client.callTool({ name: "sleep", arguments: { seconds: "x" } }), "seconds");
await expectToolError("sleep seconds out of range -> isError", client.callTool({ name: "sleep", arguments: { seconds: -1 } }), "seconds");

// A cancelled sleep: abort the call once the POST is out; the SDK sends notifications/cancelled;
// the server must answer the waiting POST with -32800 well before the 30 s sleep would end.
{
  const controller = new AbortController();
  const started = Date.now();
  const call = client.callTool({ name: "sleep", arguments: { seconds: LONG_SLEEP } }, undefined, { signal: controller.signal });
  await new Promise((r) => setTimeout(r, 500));
  const abortedAt = Date.now();
  controller.abort("peer check");
  let rejected = "";
  try {
    await call;
    rejected = "the call resolved";
  } catch (e) {
    rejected = describe(e);
  }
  const got = await waitFor(() => sleepReplies.length > 0, DEADLINE_MS);
  const reply = sleepReplies[0];
  let code;
  try {
    code = JSON.parse(reply?.body ?? "null")?.error?.code;
  } catch {
    code = undefined;
  }
  const ok = got && reply.status === 200 && code === -32800;
  report("cancelled sleep -> server answers -32800", ok,
    got ? `HTTP ${reply.status}, code ${code}, ${reply.at - abortedAt} ms after the abort (${abortedAt - started} ms in); client: ${rejected}`
      : `no reply within ${DEADLINE_MS} ms of the abort; client: ${rejected}`);
}

// The server still serves after the cancellation (the sync worker is free again).
try {
  const r = await client.callTool({ name: "echo", arguments: { text: "after" } });
  report("echo after the cancel", r.content?.[0]?.text === "after", JSON.stringify(r));
} catch (e) {
  report("echo after the cancel", false, describe(e));
}

try {
  await transport.terminateSession();
  await client.close();
  report("close (DELETE session)", true);
} catch (e) {
  report("close (DELETE session)", false, describe(e));
}

report("no transport error (transport.onerror)", transportErrors.length === 0, transportErrors.join(" | "));
// The SDK forgets a request when it is aborted, so the -32800 that contract §6.1 sends on the
// still open POST reaches Client.onerror as "a response for an unknown message ID" (the call itself
// had already rejected with the abort reason). MCP says a receiver SHOULD NOT answer a cancelled
// request; contract §6.1 answers it because the client is still waiting on that POST.
const unknownId = clientErrors.filter((e) => e.includes("unknown message ID") && e.includes("-32800"));
const otherClientErrors = clientErrors.filter((e) => !unknownId.includes(e));
report("no other client error (Client.onerror)", otherClientErrors.length === 0, otherClientErrors.join(" | "));
if (unknownId.length) report("late -32800 seen by Client.onerror as an unknown id", "note", unknownId.join(" | "));
process.exit(results.every((r) => r.ok !== false) ? 0 : 1);
