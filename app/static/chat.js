// specgate's chat page: streams /v1/chat/completions and colours each chunk by where its text
// came from, using the stream extension "speculative": {accepted, drafted, draft_chars, bytes}:
// the first draft_chars characters are accepted draft tokens, the rest the target's token.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];

$("key").value = localStorage.getItem("specgate-key") || "";
$("key").addEventListener("change", () => localStorage.setItem("specgate-key", $("key").value));
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("form").addEventListener("submit", (e) => { e.preventDefault(); send(); });

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  if (text) div.textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function piece(parent, text, kind) {
  if (!text) return;
  const span = document.createElement("span");
  span.className = kind;
  span.textContent = text;
  parent.appendChild(span);
}

function request(content) {
  history.push({ role: "user", content });
  const body = {
    model: document.body.dataset.model || "specgate",
    messages: history,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    max_tokens: 256,
  };
  const mode = $("mode").value;
  if (mode) {
    body.speculative = { mode };
    if (mode !== "autoregressive") body.speculative.num_draft_tokens = Number($("gamma").value);
  }
  return body;
}

async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function showStats(s, started) {
  $("acceptance").textContent = s.drafted ? `${(100 * s.accepted / s.drafted).toFixed(0)} %` : "–";
  const seconds = (performance.now() - started) / 1000;
  $("speed").textContent = s.tokens && seconds > 0 ? (s.tokens / seconds).toFixed(1) : "–";
  $("bytes").textContent = s.rounds ? Math.round(s.bytes / s.rounds).toLocaleString() : "–";
  $("tokens").textContent = String(s.tokens);
}

async function send() {
  const content = $("input").value.trim();
  if (!content) return;
  $("input").value = "";
  $("send").disabled = true;
  bubble("user", content);
  const answer = bubble("assistant", "");
  const stats = { accepted: 0, drafted: 0, bytes: 0, rounds: 0, tokens: 0 };
  const started = performance.now();
  let text = "";
  try {
    const headers = { "Content-Type": "application/json" };
    if ($("key").value) headers.Authorization = `Bearer ${$("key").value}`;
    const response = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(request(content)) });
    if (!response.ok) throw new Error((await response.json()).error.message);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] ? chunk.choices[0].delta.content || "" : "";
      const round = chunk.speculative;
      if (round) {
        piece(answer, delta.slice(0, round.draft_chars), "draft");
        piece(answer, delta.slice(round.draft_chars), "target");
        Object.assign(stats, {
          accepted: stats.accepted + round.accepted, drafted: stats.drafted + round.drafted,
          bytes: stats.bytes + round.bytes, rounds: stats.rounds + 1, tokens: stats.tokens + round.accepted + 1,
        });
      } else {
        piece(answer, delta, "target");
      }
      if (chunk.usage) stats.tokens = chunk.usage.completion_tokens;
      text += delta;
      showStats(stats, started);
      answer.scrollIntoView({ block: "end" });
    }
    history.push({ role: "assistant", content: text });
  } catch (err) {
    bubble("error", String(err.message || err));
    history.pop();
  } finally {
    $("send").disabled = false;
    $("input").focus();
  }
}
