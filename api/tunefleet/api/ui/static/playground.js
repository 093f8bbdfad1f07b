// The playground (templates/playground.html): each column with a model posts the prompt to
// /ui/playground/chat and shows OpenAI's streamed chat chunks as they arrive, then its
// tokens/s (generated tokens over the time from the first token to the last) and its time
// to first token. No inline script: the page's CSP forbids it.
(function () {
  "use strict";
  const form = document.getElementById("playground");
  if (!form) return;
  const headers = JSON.parse(document.body.getAttribute("hx-headers") || "{}");

  function say(stats, text, problem) {
    stats.textContent = text;
    stats.classList.toggle("problem", Boolean(problem));
  }

  async function ask(column, body) {
    const out = column.querySelector(".pg-output");
    const stats = column.querySelector(".pg-stats");
    out.textContent = "";
    column.setAttribute("aria-busy", "true");
    say(stats, "waiting for the first token…");
    const started = performance.now();
    let first = null;
    let chunks = 0;
    let usage = null;
    try {
      const resp = await fetch(form.dataset.stream, {
        method: "POST",
        headers: Object.assign({ "Content-Type": "application/json" }, headers),
        body: JSON.stringify(body),
      });
      if (!resp.ok) {
        let message = "HTTP " + resp.status;
        try {
          message += ": " + (await resp.json()).error.message;
        } catch (e) { /* not an error object */ }
        say(stats, message, true);
        return;
      }
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
            const chunk = JSON.parse(line.slice(6));
            if (chunk.error) {
              say(stats, chunk.error.message || "the model failed", true);
              return;
            }
            if (chunk.usage) usage = chunk.usage;
            for (const choice of chunk.choices || []) {
              const text = choice.delta && choice.delta.content;
              if (!text) continue;
              if (first === null) first = performance.now();
              chunks += 1;
              out.textContent += text;
            }
          }
        }
        if (first !== null) {
          const rate = chunks / Math.max((performance.now() - first) / 1000, 1e-3);
          say(stats, chunks + " tokens so far · " + rate.toFixed(1) + " tokens/s");
        }
      }
      const last = performance.now();
      const tokens = usage ? usage.completion_tokens : chunks;
      const seconds = Math.max((last - (first === null ? started : first)) / 1000, 1e-3);
      const ttft = ((first === null ? last : first) - started) / 1000;
      say(stats, tokens + " tokens · " + (tokens / seconds).toFixed(1) + " tokens/s · first token after " + ttft.toFixed(2) + " s");
      column.dataset.tokens = String(tokens);
    } catch (e) {
      say(stats, "failed: " + e, true);
    } finally {
      column.removeAttribute("aria-busy");
      column.dataset.done = "true";
    }
  }

  form.addEventListener("submit", function (event) {
    event.preventDefault();
    const prompt = form.elements.prompt.value;
    const maxTokens = Number(form.elements.max_tokens.value);
    const temperature = Number(form.elements.temperature.value);
    for (const column of form.querySelectorAll(".pg-column")) {
      delete column.dataset.done;
      delete column.dataset.tokens;
      const model = column.querySelector("select").value;
      if (!model) {
        column.querySelector(".pg-output").textContent = "";
        say(column.querySelector(".pg-stats"), "");
        column.dataset.done = "true";
        continue;
      }
      ask(column, { model: model, prompt: prompt, max_tokens: maxTokens, temperature: temperature });
    }
  });
})();
