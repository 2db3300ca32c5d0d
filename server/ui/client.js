// What the page's scripts share: the API key of this tab, and a reader of server-sent events over fetch.
// fetch rather than EventSource: EventSource cannot send an Authorization header, and a key in the URL
// would end up in logs and in the browser's history.
'use strict';

const kv = (() => {
  const KEY_NAME = 'kvserve.apiKey';

  function authHeaders() {
    const key = sessionStorage.getItem(KEY_NAME);
    return key ? {Authorization: 'Bearer ' + key} : {};
  }

  // Calls onData(text) with each event's data, until the stream ends; throws on a network error.
  async function readEvents(response, onData) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += value;
      buffer = buffer.replace(/\r\n/g, '\n');
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const lines = buffer.slice(0, cut).split('\n');
        buffer = buffer.slice(cut + 2);
        const data = lines.filter((l) => l.startsWith('data:')).map((l) => l.slice(5).replace(/^ /, '')).join('\n');
        if (data) onData(data);
      }
    }
  }

  return {
    authHeaders,
    hasKey: () => sessionStorage.getItem(KEY_NAME) !== null,
    setKey: (key) => sessionStorage.setItem(KEY_NAME, key),
    readEvents,
  };
})();
