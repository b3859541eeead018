/* Agent Ledger review desk: keyboard use and focus kept across htmx swaps. No library.
 *
 *   j / k      next / previous row of the list (queue, audit log, ...)
 *   o, Enter   open the selected row
 *   /          focus the search (or the first filter)
 *   s / r / a  on an operation: choose "Mark succeeded", "Safe to retry" or "Abandon"
 *              and move to the reason; Ctrl+Enter there records the chosen decision
 *   n          on an operation: the next item of the queue (same filter)
 *   y          on an operation whose decision was refused as stale but is still open:
 *              record it (the reason kept) on the version now shown
 *   ?          this help; Escape closes it
 *
 * Keys are ignored while typing in a field or with Ctrl/Alt/Meta held (but Ctrl+Enter in
 * a decision's reason). After a decision, "Next item" takes the focus: Enter goes on.
 * After a bulk decision the decided rows leave the list and the counts are asked again.
 *
 * The live queue: #queue-poll asks every few seconds (not while the tab is hidden) for
 * the counts, refreshed in place, and a notice when the rows changed. The rows are
 * loaded at once only while the reviewer is not working in them (nothing ticked, no row
 * selected, no focus inside the list, no decision form in use); otherwise the notice's
 * "show" link waits for them. Ticked boxes survive a refresh of the rows.
 *
 * Times: the server writes each <time> relative ("3 min ago") with the absolute time in
 * UTC on hover; here the hover text becomes the reviewer's own time zone (the browser's),
 * on load and in every fragment htmx swaps in. Without script the UTC title stays.
 */
(function () {
  "use strict";

  var selected = -1;  // index among the rows of the current list

  function rows() {
    return Array.prototype.slice.call(
      document.querySelectorAll("#results table.grid tbody tr, main table.grid.keyrows tbody tr"));
  }

  function rowLink(row) {
    return row && row.querySelector("a[href]");
  }

  function select(index) {
    var list = rows();
    if (!list.length) { return; }
    index = Math.max(0, Math.min(index, list.length - 1));
    list.forEach(function (row) {
      row.classList.remove("kb-selected");
      row.removeAttribute("aria-current");
    });
    var row = list[index];
    row.classList.add("kb-selected");
    row.setAttribute("aria-current", "true");
    selected = index;
    var link = rowLink(row);
    (link || row).focus({preventScroll: true});
    row.scrollIntoView({block: "nearest"});
  }

  function typing(target) {
    if (!target || !target.tagName) { return false; }
    var tag = target.tagName.toLowerCase();
    return tag === "input" || tag === "textarea" || tag === "select" || target.isContentEditable;
  }

  function helpDialog() {
    return document.getElementById("keys-help");
  }

  // The decision chosen with s / r / a (or the only one offered): Ctrl+Enter records it.
  function chosenButton(form) {
    var chosen = form.querySelector('button[name="to_state"][aria-pressed="true"]');
    if (chosen) { return chosen; }
    var buttons = form.querySelectorAll('button[name="to_state"]');
    if (buttons.length === 1) { return buttons[0]; }
    return form.querySelector('.btn-acknowledge') || null;
  }

  function choose(button) {
    var form = button.form;
    form.querySelectorAll('button[name="to_state"]').forEach(function (other) {
      other.setAttribute("aria-pressed", other === button ? "true" : "false");
    });
    var reason = form.querySelector("textarea[name=reason]");
    (reason || button).focus();
  }

  document.addEventListener("keydown", function (event) {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && event.target.form &&
        event.target.closest("#decision form, #decide form")) {
      var form = event.target.form;
      var button = chosenButton(form);
      event.preventDefault();
      if (button) {
        button.click();  // a click, so htmx sends the button's name and value
      } else {
        var status = form.querySelector(".choose-first");
        if (!status) {
          status = document.createElement("p");
          status.className = "msg msg-warning choose-first";
          status.setAttribute("role", "status");
          form.appendChild(status);
        }
        status.textContent = "Choose a decision first: s, r or a (or Tab to its button).";
      }
      return;
    }
  });

  document.addEventListener("keydown", function (event) {
    if (event.ctrlKey || event.altKey || event.metaKey || typing(event.target)) { return; }
    var dialog = helpDialog();
    if (dialog && dialog.open) { return; }  // the dialog handles Escape itself
    var list;
    switch (event.key) {
      case "j":
        event.preventDefault();
        select(selected + 1);
        break;
      case "k":
        event.preventDefault();
        select(selected < 0 ? 0 : selected - 1);
        break;
      case "o":
      case "Enter":
        list = rows();
        if (selected >= 0 && selected < list.length) {
          var link = rowLink(list[selected]);
          if (link && (event.key === "o" || document.activeElement === list[selected])) {
            event.preventDefault();
            link.click();
          }
        }
        break;
      case "/":
        var search = document.querySelector(
          "form.filters input[type=search], form.filters input, form.filters select");
        if (search) {
          event.preventDefault();
          search.focus();
          if (search.select) { search.select(); }
        }
        break;
      case "s":
      case "r":
      case "a":
        var state = {s: "succeeded", r: "safe_to_retry", a: "abandoned"}[event.key];
        var button = document.querySelector(
          '#decision button[name="to_state"][value="' + state + '"]');
        if (button) {
          event.preventDefault();
          choose(button);
        }
        break;
      case "y":
        var confirm = document.querySelector("#decision button[data-confirm]");
        if (confirm) {
          event.preventDefault();
          confirm.click();
        }
        break;
      case "n":
        var next = document.querySelector("a[data-next]");
        if (next) {
          event.preventDefault();
          next.click();
        }
        break;
      case "?":
        if (dialog) {
          event.preventDefault();
          dialog.showModal();
        }
        break;
    }
  });

  document.addEventListener("click", function (event) {
    var opener = event.target.closest && event.target.closest("[data-open-help]");
    var dialog = helpDialog();
    if (opener && dialog) { dialog.showModal(); }
  });

  // htmx replaces the element that had focus: remember what it was and find its
  // replacement (same id, or the same name and value), else focus the swapped region, so
  // keyboard and screen reader users never land back at the top of the page.
  var remembered = null;
  document.addEventListener("htmx:beforeSwap", function () {
    var active = document.activeElement;
    if (!active || active === document.body) { remembered = null; return; }
    remembered = {
      id: active.id,
      name: active.getAttribute("name"),
      value: active.getAttribute("value"),
      href: active.getAttribute("href"),
      row: selected
    };
  });
  document.addEventListener("htmx:afterSettle", function (event) {
    var memo = remembered;
    remembered = null;
    if (!memo) { return; }
    if (document.activeElement && document.activeElement !== document.body &&
        document.contains(document.activeElement)) { return; }
    var found = null;
    if (memo.id) { found = document.getElementById(memo.id); }
    if (!found && memo.name) {
      found = Array.prototype.slice.call(document.getElementsByName(memo.name))
        .filter(function (el) { return el.getAttribute("value") === memo.value; })[0] || null;
    }
    if (!found && memo.href) {
      found = document.querySelector('a[href="' + CSS.escape(memo.href) + '"]');
    }
    if (found) {
      found.focus({preventScroll: true});
      return;
    }
    if (memo.row >= 0 && rows().length) {
      select(memo.row);
      return;
    }
    // An outerHTML swap detaches the old target: its replacement carries the same id.
    var target = event.detail && event.detail.target;
    if (target && !document.contains(target) && target.id) {
      target = document.getElementById(target.id);
    }
    if (target && document.contains(target)) {
      if (!target.hasAttribute("tabindex")) { target.setAttribute("tabindex", "-1"); }
      target.focus({preventScroll: true});
    }
  });
  // A decision recorded: "Next item" takes the focus (Enter goes on to it).
  document.addEventListener("htmx:afterSettle", function () {
    var next = document.querySelector("a[data-focus-next]");
    if (next && !next.hasAttribute("data-focused")) {
      next.setAttribute("data-focused", "true");
      next.focus();
    }
  });

  // A decision refused as stale but still open: its confirm button takes the focus, so
  // Enter (or y) records it; the reason stays in its field.
  document.addEventListener("htmx:afterSettle", function () {
    var confirm = document.querySelector("#decision button[data-confirm]");
    if (confirm && !confirm.hasAttribute("data-focused")) {
      confirm.setAttribute("data-focused", "true");
      confirm.focus();
    }
  });

  // A bulk decision: the decided rows leave the list, nothing stays ticked, the counts
  // are asked again (the queue's "changed" notice then offers the fresh rows).
  document.addEventListener("htmx:afterSettle", function (event) {
    var target = event.detail && event.detail.target;
    if (!target || target.id !== "bulk-slot") { return; }
    target.querySelectorAll("[data-decided]").forEach(function (item) {
      var id = item.getAttribute("data-decided");
      document.querySelectorAll("input[form=bulk-form][name=items]").forEach(function (box) {
        if (box.value.slice(0, box.value.lastIndexOf("@")) === id) {
          var row = box.closest("tr");
          if (row) { row.remove(); }
        }
      });
    });
    document.querySelectorAll("input[form=bulk-form][name=items]:checked, " +
                              "#bulk-form input[name=all_matching]:checked")
      .forEach(function (box) { box.checked = false; });
    var reason = document.querySelector("#bulk-form input[name=reason]");
    if (reason) { reason.value = ""; }
    var poll = document.getElementById("queue-poll");
    if (poll && window.htmx) {
      ownDecision = true;
      window.htmx.trigger(poll, "refresh");
    }
  });

  // The counts asked again after one's own bulk decision changed only by it (no new
  // items): that is no news, so no "The queue changed since you loaded it"; the poll
  // compares with the queue as it is now from then on.
  var ownDecision = false, ownSeen = null;
  document.addEventListener("htmx:configRequest", function (event) {
    var elt = event.detail && event.detail.elt;
    if (!ownSeen || !elt || elt.id !== "queue-poll") { return; }
    var url = new URL(event.detail.path, window.location.href);
    url.searchParams.set("seen", ownSeen);
    event.detail.path = url.pathname + url.search;
  });
  document.addEventListener("htmx:afterSettle", function (event) {
    var config = event.detail && event.detail.requestConfig;
    if (!ownDecision || !config || !config.elt || config.elt.id !== "queue-poll") { return; }
    var fresh = document.getElementById("queue-fresh");
    if (!fresh) { return; }
    ownDecision = false;
    if (fresh.getAttribute("data-new") === "0") {
      ownSeen = fresh.getAttribute("data-signature");
      fresh.removeAttribute("data-changed");
      fresh.setAttribute("data-own", "true");
      fresh.textContent = "";
    }
  });

  // A note that was recorded leaves its form empty for the next one.
  document.addEventListener("htmx:afterRequest", function (event) {
    var form = event.detail && event.detail.elt;
    if (form && form.id === "add-note" && event.detail.successful) { form.reset(); }
  });

  // A list swapped in starts with no row selected.
  document.addEventListener("htmx:afterSwap", function (event) {
    if (event.detail && event.detail.target && event.detail.target.id === "results") {
      var memoRow = selected;
      selected = -1;
      if (remembered) { remembered.row = memoRow; }
    }
  });
  // --- the live queue ----------------------------------------------------------------

  function busyInQueue() {
    var results = document.getElementById("results");
    if (!results) { return true; }
    if (selected >= 0 || document.querySelector("dialog[open]")) { return true; }
    if (document.querySelector("input[form=bulk-form]:checked") ||
        results.querySelector("input[type=checkbox]:checked, details[open]")) { return true; }
    var reason = results.querySelector("#bulk-form input[name=reason]");
    if (reason && reason.value) { return true; }
    var slot = document.getElementById("bulk-slot");
    if (slot && slot.children.length) { return true; }
    var active = document.activeElement;
    return Boolean(active && active !== document.body && results.contains(active));
  }

  document.addEventListener("htmx:beforeRequest", function (event) {
    var elt = event.detail && event.detail.elt;
    if (elt && elt.id === "queue-poll" && document.hidden) { event.preventDefault(); }
  });

  document.addEventListener("htmx:afterSettle", function (event) {
    // Fired on each settled element; the poller is the element that asked.
    var config = event.detail && event.detail.requestConfig;
    if (!config || !config.elt || config.elt.id !== "queue-poll") { return; }
    var fresh = document.getElementById("queue-fresh");
    var show = fresh && fresh.getAttribute("data-changed") === "true" &&
      fresh.querySelector("a[data-show-fresh]");
    if (show && !show.hasAttribute("data-applied") && !busyInQueue()) {
      show.setAttribute("data-applied", "true");
      show.click();
    }
  });

  // Ticked operations stay ticked when the rows are loaded again (same id and version).
  var ticked = [];
  document.addEventListener("htmx:beforeSwap", function (event) {
    var target = event.detail && event.detail.target;
    if (!target || target.id !== "results") { return; }
    ticked = Array.prototype.slice.call(
      document.querySelectorAll("input[form=bulk-form][name=items]:checked"))
      .map(function (box) { return box.value; });
  });
  document.addEventListener("htmx:afterSettle", function () {
    if (!ticked.length) { return; }
    var keep = ticked;
    ticked = [];
    document.querySelectorAll("input[form=bulk-form][name=items]").forEach(function (box) {
      if (keep.indexOf(box.value) >= 0) { box.checked = true; }
    });
  });

  var localFormat = null;
  try {
    localFormat = new Intl.DateTimeFormat(undefined, {
      year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
      second: "2-digit", timeZoneName: "short"});
  } catch (error) { localFormat = null; }

  function localTimes(root) {
    if (!localFormat || !root || !root.querySelectorAll) { return; }
    root.querySelectorAll("time[datetime]").forEach(function (el) {
      var when = new Date(el.getAttribute("datetime"));
      if (isNaN(when.getTime())) { return; }
      el.title = localFormat.format(when);
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { localTimes(document); });
  } else {
    localTimes(document);
  }
  document.addEventListener("htmx:afterSettle", function (event) {
    localTimes(event.target);
  });
})();
