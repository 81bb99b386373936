// Elephant pages: copy buttons, confirmations, and the machines table's status poll (status, ban, maintenance). No framework.
"use strict";

document.addEventListener("submit", (event) => {
  const form = event.target.closest("form[data-confirm]");
  if (form && !window.confirm(form.dataset.confirm)) event.preventDefault();
});

document.addEventListener("click", (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const source = document.querySelector(button.dataset.copy);
  if (!source) return;
  navigator.clipboard.writeText(source.textContent.trim()).then(
    () => { button.textContent = "Copied"; },
    () => { window.getSelection().selectAllChildren(source); button.textContent = "Press Ctrl+C"; },
  );
});

function pollHosts(table) {
  const refresh = () =>
    fetch(table.dataset.poll, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then((response) => (response.ok ? response.json() : Promise.reject(response.status)))
      .then((body) => {
        for (const host of body.hosts) {
          const row = table.querySelector(`tr[data-host="${host.id}"]`);
          if (!row) continue;
          const badge = row.querySelector("[data-status]");
          badge.textContent = host.status;
          badge.className = `badge ${host.status}`;
          const ban = row.querySelector("[data-ban]");
          if (ban) {
            ban.hidden = !host.ban_reason;
            ban.querySelector("[data-ban-reason]").textContent = host.ban_reason || "";
          }
          const maintenance = row.querySelector("[data-maintenance]");
          if (maintenance) {
            maintenance.hidden = !host.maintenance_reason || Boolean(host.ban_reason);
            maintenance.querySelector("[data-reason]").textContent = host.maintenance_reason || "";
            maintenance.querySelector("[data-by]").textContent = host.maintenance_by || "";
            maintenance.querySelector("[data-resume]").hidden = !host.may_resume;
            maintenance.querySelector("[data-held]").hidden = host.may_resume;
          }
          const rotate = row.querySelector("[data-rotate]");
          if (rotate) rotate.hidden = Boolean(host.ban_reason);
          const jobs = row.querySelector("[data-jobs]");
          if (jobs) jobs.textContent = host.jobs;
          row.querySelector("[data-seen]").textContent = host.last_heartbeat_at ? host.last_heartbeat_at.slice(0, 19) : "never";
        }
      })
      .catch(() => {});
  setInterval(refresh, 3000);
}

document.addEventListener("DOMContentLoaded", () => {
  const table = document.querySelector("table[data-poll]");
  if (table) pollHosts(table);
});
