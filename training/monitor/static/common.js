// What the dashboard and the Join page share: fetching api/state, and writing text into the page.
// Everything from the API is written with textContent, never as HTML.
window.tttMonitor = (function () {
  "use strict";

  const API = "api/state";
  const FETCH_TIMEOUT_MS = 15000;

  const $ = (id) => document.getElementById(id);

  function setText(el, text) {
    if (el && el.textContent !== text) el.textContent = text;
  }

  // The monitor's state, and the server's Date header in ms since the epoch (NaN when absent).
  async function fetchState() {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
    try {
      const response = await fetch(API, { cache: "no-store", signal: controller.signal });
      if (!response.ok) throw new Error("HTTP " + response.status);
      const state = await response.json();
      if (!state || typeof state !== "object") throw new Error("not a state object");
      return { state, serverDate: Date.parse(response.headers.get("Date") || "") };
    } finally {
      clearTimeout(timer);
    }
  }

  return { $, setText, fetchState };
})();
