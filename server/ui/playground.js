// The playground: a chat that streams through the public POST /v1/chat/completions, the same request curl
// sends, and shows TTFT, tokens/s, finish_reason and each token coloured by its logprob.
'use strict';

const playground = (() => {
  const $ = (id) => document.getElementById(id);
  const messages = [];  // this tab's conversation only
  let controller = null;
  let info = {};

  function configure(serverInfo) {
    info = serverInfo;
    const spec = $('pg-spec');
    spec.disabled = !info.speculation_per_request;
    spec.checked = info.speculative !== 'off';
    $('pg-spec-note').textContent = info.speculation_per_request ? '(' + info.speculative + ')'
      : '(server-wide: ' + info.speculative + ')';
  }

  // A token's colour class by its probability: lp4 (p > .9) .. lp0 (p <= .1).
  function lpClass(logprob) {
    const p = Math.exp(logprob);
    return 'lp lp' + (p > 0.9 ? 4 : p > 0.6 ? 3 : p > 0.3 ? 2 : p > 0.1 ? 1 : 0);
  }

  function addMessage(role, text) {
    const div = document.createElement('div');
    div.className = 'msg ' + role;
    if (text) div.textContent = text;
    $('pg-log').appendChild(div);
    $('pg-log').scrollTop = $('pg-log').scrollHeight;
    return div;
  }

  // The request body, or throws an Error naming the bad setting.
  function body() {
    const number = (id) => ($(id).value === '' ? null : Number($(id).value));
    const request = {messages: messages.slice(), stream: true, logprobs: true, max_tokens: number('pg-max-tokens'),
      temperature: number('pg-temperature'), top_p: number('pg-top-p')};
    if (number('pg-seed') !== null) request.seed = number('pg-seed');
    if (info.speculation_per_request) request.speculative = $('pg-spec').checked;
    const schema = $('pg-schema').value.trim();
    if (schema) {
      try {
        request.response_format = {type: 'json_schema', json_schema: {name: 'playground', schema: JSON.parse(schema)}};
      } catch (e) {
        throw new Error('the JSON schema is not valid JSON: ' + e.message);
      }
    }
    return request;
  }

  function setStats(ttft, tps, tokens, finish) {
    $('pg-ttft').textContent = ttft;
    $('pg-tps').textContent = tps;
    $('pg-tokens').textContent = tokens;
    $('pg-finish').textContent = finish;
  }

  async function send(text) {
    messages.push({role: 'user', content: text});
    addMessage('user', text);
    const out = addMessage('assistant', '');
    let request;
    try {
      request = body();
    } catch (e) {
      out.className = 'msg error';
      out.textContent = e.message;
      messages.pop();
      return;
    }
    controller = new AbortController();
    $('pg-send').disabled = true;
    $('pg-stop').disabled = false;
    setStats('…', '–', 0, '–');
    const started = performance.now();
    let first = null, last = null, tokens = 0, reply = '';
    try {
      const response = await fetch('/v1/chat/completions', {method: 'POST', signal: controller.signal,
        headers: {'Content-Type': 'application/json', ...kv.authHeaders()}, body: JSON.stringify(request)});
      if (!response.ok) {
        const error = await response.json().catch(() => ({}));
        throw new Error((error.error && error.error.message) || 'HTTP ' + response.status);
      }
      await kv.readEvents(response, (data) => {
        if (data === '[DONE]') return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = chunk.choices[0];
        if (!choice) return;
        const content = (choice.delta && choice.delta.content) || '';
        const lps = (choice.logprobs && choice.logprobs.content) || [];
        if (content || lps.length) {
          const now = performance.now();
          if (first === null) {
            first = now;
            $('pg-ttft').textContent = (first - started).toFixed(0) + ' ms';
          }
          last = now;
          tokens += lps.length;
          reply += content;
          const span = document.createElement('span');
          span.textContent = content;
          if (lps.length) {
            const worst = Math.min(...lps.map((t) => t.logprob));
            span.className = lpClass(worst);
            span.title = lps.map((t) => JSON.stringify(t.token) + ' logprob ' + t.logprob.toFixed(3)).join('\n');
          }
          out.appendChild(span);
          $('pg-log').scrollTop = $('pg-log').scrollHeight;
          $('pg-tokens').textContent = tokens;
          if (tokens > 1 && last > first) $('pg-tps').textContent = ((tokens - 1) / ((last - first) / 1000)).toFixed(1);
        }
        if (choice.finish_reason) $('pg-finish').textContent = choice.finish_reason;
      });
      messages.push({role: 'assistant', content: reply});
    } catch (e) {
      const note = document.createElement('div');
      note.className = 'msg error';
      note.textContent = e.name === 'AbortError' ? 'stopped' : e.message;
      $('pg-log').appendChild(note);
      if (e.name === 'AbortError') $('pg-finish').textContent = 'stopped';
      messages.pop();
    } finally {
      controller = null;
      $('pg-send').disabled = false;
      $('pg-stop').disabled = true;
    }
  }

  document.addEventListener('DOMContentLoaded', () => {
    $('pg-form').addEventListener('submit', (event) => {
      event.preventDefault();
      const text = $('pg-input').value.trim();
      if (!text || controller) return;
      $('pg-input').value = '';
      send(text);
    });
    $('pg-input').addEventListener('keydown', (event) => {
      if (event.key === 'Enter' && !event.shiftKey) {
        event.preventDefault();
        $('pg-form').requestSubmit();
      }
    });
    $('pg-stop').addEventListener('click', () => controller && controller.abort());
    $('pg-clear').addEventListener('click', () => {
      messages.length = 0;
      $('pg-log').textContent = '';
      setStats('–', '–', '–', '–');
    });
  });

  return {configure};
})();
