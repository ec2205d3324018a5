// The Join page: fills in the install line, the `ttt train` command and the live addresses from api/state, and runs
// the memory calculator ("Will it fit?") through api/calc.
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

  // ---- the memory calculator -------------------------------------------------------------------------------
  // Every number comes from api/calc, the code behind `ttt calc --json`; this page only lays them out the way
  // `ttt calc` prints them (training/calc/command.py's render), so both show the same text for the same options.

  const CALC_DELAY_MS = 250; // typing waits for a pause before asking
  const TERMS = [
    // label, where it is kept (null: where the optimizer is), the field of the estimate
    ["parameters", "device", "parameters"],
    ["gradients", "device", "gradients"],
    ["optimizer state", null, "optimizer_state"],
    ["activations kept for backward", "device", "activations"],
    ["working memory at the peak", "device", "transient"],
    ["gradient accumulators (hivemind)", "device", "accumulators"],
    ["fp32 copies of parameters + gradients", "host", "host_copies"],
    ["auditing: a second model + its gradients", "device", "audit_model"],
    ["auditing: parameters of the last steps", "host", "audit_snapshots"],
    ["GPU allocator margin", "device", "margin"],
  ];
  const TOTALS = [
    // as TERMS, and the row's class: the GPU's and the host's totals stand out, as in `ttt calc`'s table
    ["GPU memory", "device", "device_total", "total"],
    ["host RAM", "host", "host_total", "total"],
    ["RAM on a CPU-only machine", "both", "cpu_total", ""],
  ];

  const form = $("calc-form");
  const calc = {
    started: false,
    choices: null, // api/calc/choices: the models, the choices and the setup `ttt train` runs
    runPreset: null, // this run's preset
    command: "", // the command to join this run with
    version: 0, // of the form's values: an answer to an older version is dropped
    timer: null,
    result: null, // the estimate shown
    fit: null, // the GPU memory it was asked for
  };

  // Python's f"{value:,.Nf}" for the non-negative numbers shown here. toFixed rounds the exact binary value as Python
  // does (Intl.NumberFormat rounds the shortest decimal instead, which differs), except an exact tie such as 0.125:
  // toFixed rounds it up, Python to the even digit. 25 more decimals tell a tie.
  function fixed(value, digits) {
    const exact = value.toFixed(digits + 25);
    const truncated = exact.slice(0, -25);
    const tieToEven = exact.endsWith("5" + "0".repeat(24)) && Number(truncated.slice(-1)) % 2 === 0;
    const [whole, fraction] = (tieToEven ? truncated : value.toFixed(digits)).split(".");
    return whole.replace(/\B(?=(\d{3})+$)/g, ",") + "." + fraction;
  }

  function gib(bytes) {
    return fixed(bytes / 2 ** 30, 2) + " GiB";
  }

  // Python's f"{value:g}" for the speeds and sizes people type: 6 significant digits, no trailing zeros.
  function short(value) {
    return String(Number(value.toPrecision(6)));
  }

  function fieldValue(field) {
    return field.type === "checkbox" ? field.checked : field.value;
  }

  function setFields(values) {
    for (const [name, value] of Object.entries(values)) {
      const field = form.elements[name];
      if (field.type === "checkbox") field.checked = Boolean(value);
      else field.value = String(value);
    }
  }

  function fillSelect(select, names, labels) {
    const options = names.map((name) => {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = labels[name] || name;
      return option;
    });
    select.replaceChildren(...options);
  }

  // What `ttt train` fixes: the batch size it advises is only right for the command when these are as it runs them.
  function trainSetup() {
    const defaults = calc.choices.defaults;
    return {
      preset: calc.runPreset,
      optimizer: defaults.optimizer,
      precision: defaults.precision,
      offload: defaults.offload,
      reversible: calc.choices.reversible.includes(calc.runPreset),
      checkpointing: defaults.checkpointing,
      audits: defaults.audits,
    };
  }

  function runsAsTrain() {
    const train = trainSetup();
    return Object.keys(train).every((name) => fieldValue(form.elements[name]) === train[name]);
  }

  function row(cells, className) {
    const tr = document.createElement("tr");
    if (className) tr.className = className;
    cells.forEach((text, index) => {
      const td = document.createElement("td");
      if (index === cells.length - 1) td.className = "num";
      td.textContent = text;
      tr.appendChild(td);
    });
    return tr;
  }

  function listItem(text) {
    const li = document.createElement("li");
    li.textContent = text;
    return li;
  }

  function showResult() {
    const result = calc.result;
    const setup = result.setup;
    setText($("calc-title"), result.model + ": " + fixed(result.parameters_count / 1e6, 1) + " M parameters");
    const optimizerPlace = setup.offload ? "host" : "device";
    const terms = TERMS.filter(([, , key]) => result[key]).map(([name, where, key]) =>
      row([name, where || optimizerPlace, gib(result[key])]),
    );
    $("calc-terms").replaceChildren(...terms);
    const totals = TOTALS.map(([name, where, key, className]) => row([name, where, gib(result[key])], className));
    $("calc-totals").replaceChildren(...totals);

    const lines = [];
    if (result.transfer_per_step) {
      lines.push(
        "offloading copies " + fixed(result.transfer_per_step / 1e9, 2) + " GB between host and GPU per global step: " +
          fixed(result.transfer_seconds, 2) + " s at " + short(setup.pcie_gbyte) + " GB/s",
      );
    }
    if (setup.swarm) {
      lines.push(
        "averaging sends " + fixed(result.averaging_per_step / 1e6, 1) + " MB per global step in a group of " +
          setup.peers + " (8-bit gradients, parameters every 10 steps): " + fixed(result.averaging_seconds, 1) +
          " s at " + short(setup.uplink_mbit) + " Mbit/s up",
      );
    }
    $("calc-traffic").replaceChildren(...lines.map(listItem));

    const fit = short(calc.fit) + " GiB of GPU memory";
    const largest = result.largest_batch_size;
    setText(
      $("calc-advice"),
      largest ? "the largest --batch-size that fits " + fit + ": " + largest : "not even --batch-size 1 fits " + fit,
    );
    $("calc-advice").classList.toggle("calc-advice-bad", !largest);
    showJoin();
  }

  // The command to join with at the advised batch size, or why there is none.
  function showJoin() {
    const largest = calc.result.largest_batch_size;
    const asTrain = runsAsTrain();
    $("calc-join").hidden = !(asTrain && largest);
    if (asTrain && largest) setText($("calc-command"), calc.command + " --batch-size " + largest);
    let note = "";
    if (!asTrain) {
      const train = trainSetup();
      const optimizer = train.optimizer + " optimizer state" + (train.offload ? " offloaded to host RAM" : "");
      const parts = [train.preset, optimizer, train.precision]
        .concat(train.reversible ? ["reversible layers"] : [])
        .concat(train.audits ? ["auditing others' work"] : []);
      note = "The command to join with is for what ttt train runs: " + parts.join(", ") + ".";
    } else if (!largest) {
      note = "Too little for this model on a GPU: join with --device cpu if this machine has the RAM of a CPU-only " +
        "machine above.";
    }
    setText($("calc-note"), note);
    $("calc-note").hidden = !note;
  }

  function setState(state) {
    const card = $("calc");
    card.dataset.state = state;
    card.setAttribute("aria-busy", String(state === "loading" || state === "pending"));
    $("calc-error").hidden = state !== "error";
    $("calc-result").hidden = state === "error" || !calc.result;
  }

  async function calculate(version) {
    const params = new URLSearchParams();
    for (const field of form.elements) {
      if (field.name) params.set(field.name, String(fieldValue(field)));
    }
    let answer;
    try {
      const response = await fetch("api/calc?" + params, { cache: "no-store" });
      answer = { ok: response.ok, body: await response.json() };
    } catch (err) {
      answer = { ok: false, body: { error: "the calculator did not answer (" + ((err && err.message) || err) + ")" } };
    }
    if (version !== calc.version) return; // the form changed meanwhile: the answer to its new values is coming
    if (answer.ok) {
      calc.result = answer.body;
      calc.fit = Number(params.get("fit_gib"));
      showResult();
      setState("ok");
    } else {
      calc.result = null;
      setText($("calc-error"), str(answer.body && answer.body.error, "the calculator failed"));
      setState("error");
    }
  }

  function schedule() {
    $("calc-reset").hidden = runsAsTrain();
    calc.version += 1;
    const version = calc.version;
    setState("pending");
    clearTimeout(calc.timer);
    calc.timer = setTimeout(() => calculate(version), CALC_DELAY_MS);
  }

  function onInput(event) {
    const { preset, reversible, checkpointing } = form.elements;
    if (event.target === preset) reversible.checked = calc.choices.reversible.includes(preset.value);
    // Reversible layers and checkpointing are two ways to recompute activations: a setup uses one at most.
    if (event.target === checkpointing && checkpointing.checked) reversible.checked = false;
    else if (reversible.checked) checkpointing.checked = false;
    schedule();
  }

  // Starts once the first state names the run's preset, which the form starts from.
  async function startCalculator(preset) {
    calc.started = true;
    try {
      const response = await fetch("api/calc/choices", { cache: "no-store" });
      if (!response.ok) throw new Error("HTTP " + response.status);
      calc.choices = await response.json();
    } catch (err) {
      calc.started = false; // the next refresh tries again
      setText($("calc-status"), "The calculator could not load (" + ((err && err.message) || err) + "); retrying.");
      return;
    }
    const choices = calc.choices;
    calc.runPreset = choices.models.includes(preset) ? preset : choices.defaults.preset;
    fillSelect(form.elements.preset, choices.models, { [calc.runPreset]: calc.runPreset + " (this run)" });
    fillSelect(form.elements.optimizer, choices.optimizers, {});
    fillSelect(form.elements.precision, choices.precisions, {});
    setFields({ ...choices.defaults, ...trainSetup() });
    form.addEventListener("input", onInput);
    form.addEventListener("submit", (event) => event.preventDefault()); // Enter in a field: nothing to send
    $("calc-reset").addEventListener("click", () => {
      setFields(trainSetup());
      schedule();
    });
    form.removeAttribute("inert");
    $("calc-status").hidden = true;
    calc.version += 1;
    calculate(calc.version);
  }

  // ---- rendering ---------------------------------------------------------------------------------------------

  // The run's own wheel, served by the monitor (the very ttt the run uses), once it is built.
  function installLine(join) {
    const wheel = str(join.wheel, "");
    if (!wheel) return str(join.install, "pip install 'ttt[train]'");
    return "pip install 'ttt[train] @ " + location.origin + "/wheel/" + encodeURIComponent(wheel) + "'";
  }

  // This monitor's address as the visitor reached it (the page's own URL, without /join): `ttt train --join` reads
  // the run's settings and the peers' addresses from its api/state.
  function monitorUrl() {
    const base = new URL(".", window.location.href).href;
    return base.endsWith("/") && base.length > window.location.origin.length + 1 ? base.slice(0, -1) : window.location.origin;
  }

  function render(s) {
    const join = s.join && typeof s.join === "object" ? s.join : {};
    const runId = str(join.run_id, str(s.run_id, "?"));
    setText($("run-id"), runId);
    document.title = "Join run " + runId + " · ttt";
    setText($("install"), installLine(join));
    calc.command = "ttt train --join " + monitorUrl();
    setText($("command"), calc.command);
    if (!calc.started) {
      startCalculator(str(join.preset, ""));
    } else if (calc.result) {
      showJoin(); // the addresses in the command may have changed
    }

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
