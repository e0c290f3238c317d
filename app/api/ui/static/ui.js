// maec-service /ui: live progress on a job's page, and the status filter's auto-submit.
// No framework and no inline script (the pages' CSP allows scripts from here only).
"use strict";

(function () {
  function text(id, value) {
    var el = document.getElementById(id);
    if (el) { el.textContent = value; }
  }

  function show(state) {
    var status = document.getElementById("status");
    if (status) {
      status.textContent = state.status;
      status.className = "status s-" + state.status;
    }
    text("stage", state.stage || "-");
    var p = state.progress || {};
    var bar = document.getElementById("progress");
    if (bar) { bar.value = p.fraction || 0; }
    var pct = Math.round((p.fraction || 0) * 1000) / 10;
    text("progress-text", pct + " %" + (p.total ? " (" + p.done + "/" + p.total + ")" : ""));
    text("duration", state.duration || "-");
  }

  function poll(live) {
    var url = live.getAttribute("data-state");
    var delay = 1000;
    function tick() {
      fetch(url, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) {
          if (r.status === 401) { window.location.assign("/ui/login"); return null; }
          return r.ok ? r.json() : null;
        })
        .then(function (state) {
          if (state === null) { delay = Math.min(delay * 2, 10000); }
          else {
            show(state);
            // The result (files, evaluation, plots) is rendered by the server.
            if (state.terminal) { window.location.reload(); return; }
            delay = 1000;
          }
          window.setTimeout(tick, delay);
        })
        .catch(function () {
          delay = Math.min(delay * 2, 10000);
          window.setTimeout(tick, delay);
        });
    }
    window.setTimeout(tick, 500);
  }

  document.addEventListener("DOMContentLoaded", function () {
    var live = document.getElementById("live");
    if (live && live.getAttribute("data-terminal") === "false") { poll(live); }
    var select = document.querySelector("select[data-autosubmit]");
    if (select) {
      select.addEventListener("change", function () { select.form.submit(); });
    }
  });
})();
