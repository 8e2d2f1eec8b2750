// The dashboard's page: renders the snapshots /dashboard/events sends (about one a
// second; app/server/dashboard.py says what a snapshot holds) and charts the last
// few minutes of them with uPlot. Every value goes in as text (textContent), never
// as markup: subscriber ids and task ids come from clients.
"use strict";

(() => {
  const POINTS = 300; // five minutes at one snapshot a second
  const RECONNECT_MS = 5000;

  const $ = (id) => document.getElementById(id);
  const dash = "—";

  // -- formatting -------------------------------------------------------------

  const integer = (n) => (n == null ? dash : Math.round(n).toLocaleString("en-US"));
  function bytes(n) {
    if (n == null) return dash;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return `${i === 0 ? n : n.toFixed(1)} ${units[i]}`;
  }
  function seconds(s) {
    if (s == null) return dash;
    if (s < 1) return `${Math.round(s * 1000)} ms`;
    if (s < 120) return `${s.toFixed(1)} s`;
    if (s < 7200) return `${(s / 60).toFixed(1)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }
  const text = (v) => (v == null || v === "" ? dash : String(v));
  const plural = (n, one, many) => `${integer(n)} ${n === 1 ? one : many}`;
  function clipped(s, length = 160) {
    return s.length > length ? `${s.slice(0, length - 1)}…` : s;
  }

  function set(id, value) {
    const el = $(id);
    if (el.textContent !== value) el.textContent = value;
  }
  function pill(id, label, kind) {
    const el = $(id);
    set(id, label);
    el.className = `pill ${kind}`;
  }
  function cell(row, value, className) {
    const td = document.createElement("td");
    td.textContent = value;
    if (className) td.className = className;
    row.appendChild(td);
    return td;
  }

  // -- charts -----------------------------------------------------------------

  const history = {
    t: [], tps: [], upstreamLag: [], subscriberLag: [], backupLag: [], backlog: [], storer: [],
  };
  let previous = null; // the last snapshot, for rates

  const clock = (seconds) =>
    new Date(seconds * 1000).toLocaleTimeString([], {
      hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false,
    });

  // The points' span, at least the last minute (one point has no span of its own).
  function timeRange(u, min, max) {
    const t = u.data[0];
    if (!t.length) return [min, max];
    const last = t[t.length - 1];
    return [Math.min(t[0], last - 60), last];
  }

  function chart(id, series) {
    const el = $(id);
    const opts = {
      width: Math.max(200, el.clientWidth),
      height: 160,
      legend: { show: true, live: false },
      cursor: { show: false },
      scales: { x: { time: true, range: timeRange } },
      axes: [{ values: (u, splits) => splits.map(clock), space: 80 }, { size: 60 }],
      series: [{}, ...series],
    };
    return new uPlot(opts, [[], ...series.map(() => [])], el);
  }
  const charts = {
    throughput: chart("chart-throughput", [
      { label: "tx/s", stroke: "#2f6fdb", width: 1.5 },
    ]),
    lag: chart("chart-lag", [
      { label: "upstream", stroke: "#2f6fdb", width: 1.5 },
      { label: "slowest subscriber", stroke: "#c2410c", width: 1.5 },
      { label: "backup", stroke: "#15803d", width: 1.5 },
    ]),
    backlog: chart("chart-backlog", [
      { label: "subscribers", stroke: "#c2410c", width: 1.5 },
      { label: "storer queue", stroke: "#7c3aed", width: 1.5 },
    ]),
  };
  new ResizeObserver(() => {
    for (const [name, plot] of Object.entries(charts)) {
      const el = $(`chart-${name}`);
      plot.setSize({ width: Math.max(200, el.clientWidth), height: 160 });
    }
  }).observe(document.querySelector(".charts"));

  function record(s) {
    const t = s.time / 1000;
    let tps = null;
    const tx = s.stream.transactions;
    if (previous && tx != null && previous.stream.transactions != null && t > previous.time / 1000) {
      tps = Math.max(0, (tx - previous.stream.transactions) / (t - previous.time / 1000));
    }
    const lags = s.subscribers.map((sub) => sub.lagMs / 1000);
    const point = {
      t,
      tps,
      upstreamLag: s.upstream.lagSeconds ?? null,
      subscriberLag: lags.length ? Math.max(...lags) : null,
      backupLag: s.backup.lagSeconds ?? null,
      backlog: s.subscribers.reduce((sum, sub) => sum + (sub.bufferedBytes || 0), 0),
      storer: s.stream.storerQueuedBytes ?? null,
    };
    for (const key of Object.keys(history)) {
      history[key].push(point[key]);
      if (history[key].length > POINTS) history[key].shift();
    }
    charts.throughput.setData([history.t, history.tps]);
    charts.lag.setData([history.t, history.upstreamLag, history.subscriberLag, history.backupLag]);
    charts.backlog.setData([history.t, history.backlog, history.storer]);
    return tps;
  }

  // -- sections ---------------------------------------------------------------

  function renderHeader(s) {
    if (s.ready.ok) pill("ready", "ready", "ok");
    else pill("ready", `not ready: ${s.ready.reason}`, "bad");
    set("updated", `updated ${new Date(s.time).toLocaleTimeString()}`);
    const errors = Object.entries(s.errors || {}).map(([group, message]) => `${group}: ${message}`);
    $("errors").hidden = errors.length === 0;
    set("errors", errors.join(" · "));
  }

  function renderUpstream(u) {
    set("upstream-type", text(u.type));
    const age = u.lastCommitAgeSeconds == null ? "" : ` (${seconds(u.lastCommitAgeSeconds)} ago)`;
    set("upstream-last-commit", u.lastCommit == null ? dash : `${u.lastCommit}${age}`);
    set("upstream-lag", u.lagSeconds == null ? "no lag report" : seconds(u.lagSeconds));
    // Postgres: every slot of the shard (an old replica's slot pins WAL too).
    const slots = (u.slots || []).map((slot) => {
      const line = document.createElement("div");
      line.className = "slot";
      line.textContent =
        `${slot.slot}: ${bytes(slot.retainedWalBytes)}` +
        (slot.unconfirmedWalBytes == null ? "" : ` (${bytes(slot.unconfirmedWalBytes)} unconfirmed)`);
      return line;
    });
    if (slots.length) $("upstream-slots").replaceChildren(...slots);
    else set("upstream-slots", u.type === "pg" ? "not read yet" : "no slots (not Postgres)");
  }

  function renderStream(st, tps) {
    const rate = tps == null ? "" : ` (${tps.toFixed(1)}/s)`;
    set("stream-transactions", `${integer(st.transactions)}${rate}`);
    set("stream-changes", integer(st.changes));
    set("stream-durable", text(st.durableWatermark));
    set("stream-storer", bytes(st.storerQueuedBytes));
    const loop = st.eventLoopLagMs;
    set("stream-loop-lag", loop ? `${loop.latest} ms (max ${loop.max60s} ms in 60 s)` : dash);
    const fc = st.flowControl;
    set(
      "stream-releases",
      fc
        ? `${integer(fc.waits["all-subscribers"])} by all, ` +
            `${integer(fc.waits["consensus-timeout"])} by timeout (${seconds(fc.waitSeconds)} waited)`
        : dash,
    );
  }

  function renderChangeLog(c) {
    set("changelog-rows", integer(c.rows));
    set("changelog-bytes", bytes(c.bytes));
    set("changelog-min", text(c.minWatermark));
    set("changelog-max", text(c.maxWatermark));
    const purge = c.purge || {};
    set("changelog-floor", text(purge.floor));
    set("changelog-held-by", text(purge.heldBy));
    set(
      "changelog-purged",
      purge.passes == null
        ? dash
        : `${plural(purge.rowsDeleted, "row", "rows")} in ${plural(purge.passes, "pass", "passes")}` +
            (purge.purgedBelow ? `, below ${purge.purgedBelow}` : ""),
    );
  }

  function renderBackup(b) {
    if (b.gate.open) pill("backup-gate", "open", "ok");
    else pill("backup-gate", "closed", "bad");
    set("backup-reason", b.gate.open ? (b.url ? "the backup covers the replica" : "no backups configured") : text(b.gate.reason));
    set("backup-url", b.url ? b.url : "none (the local replica's position is the purge floor)");
    set("backup-watermark-label", b.url ? "backed up to" : "replica at");
    set("backup-watermark", text(b.watermark));
    const write = b.writeLagSeconds == null ? "" : `, replica writes ${seconds(b.writeLagSeconds)} ahead`;
    set("backup-lag", b.lagSeconds == null ? dash : `${seconds(b.lagSeconds)}${write}`);
    const ls = b.litestream;
    let state = b.url ? "not running" : "not used";
    if (ls) {
      const starts = plural(ls.starts, "start", "starts");
      state = ls.pid ? `running (pid ${ls.pid}, ${starts})` : `stopped (${starts})`;
      if (ls.lastExit != null) state += `, last exit ${ls.lastExit}`;
    }
    set("backup-litestream", state);
    const errors = [];
    if (ls && ls.recentErrors && ls.recentErrors.length) errors.push(`litestream: ${ls.recentErrors.at(-1)}`);
    if (b.probeError) errors.push(`probe: ${b.probeError}`);
    const error = $("backup-error");
    set("backup-error", errors.length ? clipped(errors.join(" · ")) : dash);
    error.title = errors.join("\n");
  }

  function renderReservations(r) {
    const list = $("reservations");
    list.replaceChildren();
    for (const held of r.open) {
      const item = document.createElement("li");
      const at = held.watermark ? `at ${held.watermark}` : "not confirmed yet";
      item.textContent = `${held.taskID}: open ${seconds(held.openSeconds)}, ${at}`;
      list.appendChild(item);
    }
    if (!r.open.length) {
      const item = document.createElement("li");
      item.className = "muted";
      item.textContent = "none";
      list.appendChild(item);
    }
    set("reservations-longest", seconds(r.longestSeconds));
  }

  function catchUp(sub) {
    const td = document.createElement("td");
    td.className = "catch-up";
    const progress = sub.catchUp.progress;
    if (!sub.catchingUp) {
      td.textContent = "live";
      return td;
    }
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("span");
    fill.style.width = `${Math.round((progress || 0) * 100)}%`;
    bar.appendChild(fill);
    td.appendChild(bar);
    const to = sub.catchUp.to ? ` to ${sub.catchUp.to}` : " (waiting to start)";
    td.appendChild(document.createTextNode(`${progress == null ? "" : Math.round(progress * 100) + "%"}${to}`));
    return td;
  }

  function renderSubscribers(subscribers) {
    set("subscriber-count", `(${subscribers.length})`);
    const body = $("subscribers").tBodies[0];
    const rows = [];
    for (const sub of subscribers) {
      const row = document.createElement("tr");
      row.dataset.subscriber = sub.id;
      if (sub.lagging) row.className = "lagging";
      cell(row, sub.id, "id");
      cell(row, text(sub.taskID), "task");
      cell(row, sub.state === "queued" ? `${sub.mode} (queued)` : sub.mode, "mode");
      cell(row, `v${sub.protocolVersion}`, "protocol");
      cell(row, sub.watermark, "watermark");
      cell(row, sub.acked, "acked");
      cell(row, `${bytes(sub.bufferedBytes)} / ${integer(sub.pendingMessages)} msgs`, "num backlog");
      cell(row, integer(sub.lagMs), "num lag-ms");
      cell(row, integer(sub.lagTransactions), "num lag-tx");
      cell(row, integer(sub.missedReleases), "num releases");
      row.appendChild(catchUp(sub));
      rows.push(row);
    }
    if (!rows.length) {
      const row = document.createElement("tr");
      row.className = "empty";
      const td = cell(row, "no subscribers", "muted");
      td.colSpan = 11;
      rows.push(row);
    }
    body.replaceChildren(...rows);
  }

  function render(s) {
    if (s.error) {
      $("errors").hidden = false;
      set("errors", s.error);
      return;
    }
    const tps = record(s);
    renderHeader(s);
    renderUpstream(s.upstream);
    renderStream(s.stream, tps);
    renderChangeLog(s.changeLog);
    renderBackup(s.backup);
    renderReservations(s.reservations);
    renderSubscribers(s.subscribers);
    previous = s;
  }

  // -- the stream -------------------------------------------------------------

  function connect() {
    const events = new EventSource("dashboard/events");
    events.onopen = () => pill("connection", "live", "ok");
    events.onmessage = (event) => render(JSON.parse(event.data));
    events.onerror = () => {
      if (events.readyState === EventSource.CLOSED) {
        // Refused (503: too many streams) or gone for good: try again later.
        pill("connection", "disconnected; retrying", "bad");
        setTimeout(connect, RECONNECT_MS);
      } else {
        pill("connection", "reconnecting", "warn");
      }
    };
  }
  connect();
})();
