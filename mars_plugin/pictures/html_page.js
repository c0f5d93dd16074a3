"use strict";
// report.html's own script (its sha256 is in the page's Content-Security-Policy: nothing else runs).
// Every text from the data (class names, stems) reaches the DOM through text() or setAttribute,
// never as HTML. The view (class, page) lives in the URL hash: report.html#class=boat&page=2.
(function () {
  var D = window.MARS_REPORT, PER_PAGE = 24, PANELS = ["image", "pseudo", "debiased", "gt"];
  function el(tag, cls, parent) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (parent) { parent.appendChild(e); }
    return e;
  }
  function text(e, s) { e.textContent = s; return e; }
  function pct(x) { return x === null ? "n/a" : (100 * x).toFixed(1) + "%"; }
  function num(x, d) { return x === null ? "n/a" : x.toFixed(d); }
  function thumb(i, panel) {
    var ext = panel === "image" ? ".jpg" : ".png", n = String(i);
    while (n.length < 6) { n = "0" + n; }
    var f = String(Math.floor(i / 1000));
    while (f.length < 3) { f = "0" + f; }
    return "thumbs/" + f + "/" + n + "_" + panel + ext;
  }
  function state() {
    var s = { cls: "", page: 1 };
    location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var p = kv.split("="), v = decodeURIComponent(p[1] || "");
      if (p[0] === "class") { s.cls = v; } else if (p[0] === "page") { s.page = parseInt(v, 10) || 1; }
    });
    return s;
  }
  function ranking(parent, c) {  // Eq. 1-3: each candidate's distance to the background, the top alpha kept
    var r = c.centroids;
    if (!r || !r.distances.length) { return text(parent, r ? r.kept + " of " + r.candidates + " kept" : "n/a"); }
    var box = el("div", "rank", parent), max = r.distances[0] || 1, n = r.distances.length;
    var step = Math.max(1, n / 120);
    for (var j = 0; j < n; j += step) {
      var k = Math.floor(j), bar = el("span", k < r.kept_drawn ? "kept" : "cut", box);
      bar.style.height = Math.max(1, Math.round(28 * r.distances[k] / max)) + "px";
      bar.setAttribute("title", (k < r.kept_drawn ? "kept: " : "treated as biased: ") + r.distances[k].toFixed(4));
    }
    text(el("div", "note", parent), r.kept + " of " + r.candidates + " kept (alpha), cut at " + num(r.cut, 4));
  }
  function classTable() {
    var t = document.getElementById("classes"), head = el("tr", "", t);
    var cols = ["class", "images", "pixels labelled", "marked biased", "debiased IoU", "FP", "FN", "pseudo IoU"];
    if (D.paper) { cols.push("paper val RS+EPM", "paper val MARS"); }
    cols.push("centroid ranking (distance to the background, kept in colour)");
    cols.forEach(function (h) { text(el("th", "", head), h); });
    D.classes.forEach(function (c) {
      var tr = el("tr", "", t), a = el("a", "", el("td", "", tr));
      text(a, c.name);
      a.setAttribute("href", "#class=" + encodeURIComponent(c.name) + "&page=1");
      [String(c.images), String(c.pixels), pct(c.share), pct(c.iou), num(c.fp, 3), num(c.fn, 3),
       pct(c.iou_pseudo)].forEach(function (v) { text(el("td", "n", tr), v); });
      if (D.paper) { [c.paper_rs, c.paper_mars].forEach(function (v) { text(el("td", "n", tr), v === null ? "n/a" : v.toFixed(1)); }); }
      ranking(el("td", "", tr), c);
    });
  }
  function gallery() {
    var s = state(), sel = document.getElementById("filter"), byName = {};
    D.classes.forEach(function (c) { byName[c.name] = c; });
    var c = byName[s.cls] || null, rows = [];
    sel.value = c ? c.name : "";
    D.images.forEach(function (im, i) {
      var px = 0, rm = 0;
      im[1].forEach(function (t) { if (!c || t[0] === c.id) { px += t[1]; rm += t[2]; } });
      if (px > 0) { rows.push([rm / px, rm, px, i]); }
    });
    rows.sort(function (a, b) { return b[0] - a[0] || b[1] - a[1] || a[3] - b[3]; });
    var pages = Math.max(1, Math.ceil(rows.length / PER_PAGE)), page = Math.min(Math.max(1, s.page), pages);
    text(document.getElementById("pageinfo"), "page " + page + " of " + pages + " (" + rows.length + " images" +
         (c ? " with " + c.name : "") + ", most marked biased first)");
    var g = document.getElementById("gallery");
    while (g.firstChild) { g.removeChild(g.firstChild); }
    rows.slice((page - 1) * PER_PAGE, page * PER_PAGE).forEach(function (r) {
      var card = el("div", "card", g), strip = el("div", "strip", card);
      card.setAttribute("data-stem", D.images[r[3]][0]);
      PANELS.forEach(function (p) {
        if (p === "gt" && !D.has_gt) { return; }
        var img = el("img", "", strip);
        img.setAttribute("loading", "lazy");
        img.setAttribute("alt", p);
        img.setAttribute("title", p);
        img.setAttribute("src", thumb(r[3], p));
      });
      text(el("div", "stem", card), D.images[r[3]][0]);
      text(el("div", "note", card), pct(r[0]) + " of " + (c ? "its " + c.name : "its foreground") + " pixels marked biased (" +
           r[1] + " of " + r[2] + ")");
    });
    document.getElementById("prev").setAttribute("href", "#class=" + encodeURIComponent(s.cls) + "&page=" + Math.max(1, page - 1));
    document.getElementById("next").setAttribute("href", "#class=" + encodeURIComponent(s.cls) + "&page=" + Math.min(pages, page + 1));
    document.body.setAttribute("data-view", (c ? c.name : "") + "|" + page);
  }
  function figures() {
    var f = document.getElementById("figures");
    D.figures.forEach(function (x) {
      var fig = el("figure", "", f), img = el("img", "", fig);
      img.setAttribute("src", x[1]);
      img.setAttribute("alt", x[0]);
      text(el("figcaption", "", fig), x[0]);
    });
  }
  function init() {
    text(document.getElementById("title"), D.title);
    text(document.getElementById("summary"), D.num_images + " images; " + D.share_definition + "." +
         (D.paper ? " Paper columns: " + D.paper + "." : ""));
    var sel = document.getElementById("filter");
    text(el("option", "", sel), "all classes (share of the foreground)").setAttribute("value", "");
    D.classes.forEach(function (c) { text(el("option", "", sel), c.name).setAttribute("value", c.name); });
    sel.addEventListener("change", function () { location.hash = "class=" + encodeURIComponent(sel.value) + "&page=1"; });
    classTable();
    figures();
    gallery();
    window.addEventListener("hashchange", gallery);
    document.body.setAttribute("data-ready", "1");
  }
  init();
})();
