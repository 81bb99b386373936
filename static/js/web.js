// Elephant pages: copy buttons, and the machines table's status poll (status, maintenance reason). No framework.
"use strict";

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
          const maintenance = row.querySelector("[data-maintenance]");
          if (maintenance) {
            maintenance.hidden = !host.maintenance_reason;
            maintenance.querySelector("[data-reason]").textContent = host.maintenance_reason || "";
          }
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
