// The Join page: fills in the install line, the `ttt train` command and the live addresses from api/state.
// Everything from the API is written with textContent, never as HTML.
(function () {
  "use strict";

  const { $, setText } = tttMonitor;
  const MIN_POLL_SECONDS = 2;

  let refreshSeconds = 10;
  let loaded = false;
  let addressesKey = null;
  let renders = 0;

  function str(v, fallback) {
    return typeof v === "string" && v ? v : fallback;
  }

  // ---- copying -----------------------------------------------------------------------------------------------

  function selectContents(node) {
    const range = document.createRange();
    range.selectNodeContents(node);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  function copyWithTextarea(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.top = "0";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch (err) {
      ok = false;
    }
    area.remove();
    return ok;
  }

  async function copy(button, source) {
    const text = source.textContent;
    let ok = false;
    if (navigator.clipboard && window.isSecureContext) {
      try {
        await navigator.clipboard.writeText(text);
        ok = true;
      } catch (err) {
        ok = false;
      }
    }
    if (!ok) ok = copyWithTextarea(text);
    if (!ok) selectContents(source); // let the visitor press Ctrl-C
    button.textContent = ok ? "copied" : "press Ctrl-C";
    button.classList.toggle("copied", ok);
    clearTimeout(button._reset);
    button._reset = setTimeout(() => {
      button.textContent = "copy";
      button.classList.remove("copied");
    }, 1800);
  }

  function copyable(text, id) {
    const box = document.createElement("div");
    box.className = "copyable";
    const pre = document.createElement("pre");
    if (id) pre.id = id;
    pre.textContent = text;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "copy";
    button.addEventListener("click", () => copy(button, pre));
    box.appendChild(pre);
    box.appendChild(button);
    return box;
  }

  for (const button of document.querySelectorAll("button.copy[data-copy]")) {
    const source = $(button.dataset.copy);
    button.addEventListener("click", () => copy(button, source));
  }

  // ---- rendering ---------------------------------------------------------------------------------------------

  function render(s) {
    const join = s.join && typeof s.join === "object" ? s.join : {};
    const runId = str(join.run_id, str(s.run_id, "?"));
    setText($("run-id"), runId);
    document.title = "Join run " + runId + " · ttt";
    setText($("install"), str(join.install, "pip install 'ttt[train]'"));
    setText($("command"), str(join.command, "ttt train --stream --run-id " + runId));

    const addresses = Array.isArray(join.addresses) ? join.addresses.filter((a) => typeof a === "string" && a) : [];
    const key = JSON.stringify(addresses);
    if (key !== addressesKey) {
      addressesKey = key;
      const list = $("addresses");
      const items = document.createDocumentFragment();
      if (!addresses.length) {
        const li = document.createElement("li");
        li.className = "muted";
        li.textContent = "no peer address known yet: the monitor has not found a running peer (this page refreshes)";
        items.appendChild(li);
      }
      for (const address of addresses) {
        const li = document.createElement("li");
        li.appendChild(copyable(address));
        items.appendChild(li);
      }
      list.replaceChildren(items);
      setText(
        $("addresses-count"),
        addresses.length ? addresses.length + (addresses.length === 1 ? " address" : " addresses") : "",
      );
    }
    if (typeof s.refresh_seconds === "number" && Number.isFinite(s.refresh_seconds)) {
      refreshSeconds = s.refresh_seconds;
    }
    renders += 1;
    document.body.dataset.renders = String(renders);
  }

  function showStatus(ok, error) {
    const status = $("status");
    const banner = $("banner");
    if (ok) {
      status.className = "status status-ok";
      setText(status, "live");
      banner.hidden = true;
    } else {
      status.className = "status status-down";
      setText(status, "monitor unreachable, retrying");
      banner.hidden = false;
      setText(
        banner,
        "Cannot reach the monitor (" + error + ")." + (loaded ? " The commands below may be out of date." : ""),
      );
    }
  }

  async function poll() {
    let s = null;
    try {
      s = (await tttMonitor.fetchState()).state;
    } catch (err) {
      showStatus(false, err && err.name === "AbortError" ? "timed out" : String((err && err.message) || err));
    }
    if (s && !(s.join && typeof s.join === "object")) {
      // The monitor is up but has not refreshed yet (it serves {} until then): ask again soon.
      setText($("status"), "waiting for the monitor's first refresh");
      setTimeout(poll, MIN_POLL_SECONDS * 1000);
      return;
    }
    if (s) {
      try {
        render(s);
        loaded = true;
        showStatus(true);
      } catch (err) {
        console.error("join: could not render the state", err);
      }
    }
    setTimeout(poll, Math.max(MIN_POLL_SECONDS, refreshSeconds) * 1000);
  }

  poll();
})();
