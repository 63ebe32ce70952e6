// trainguard report: the charts are inline SVG drawn by Python; this only checks they laid out and
// lets a legend key hide or show its series. No network, no libraries, nothing logged.
(function () {
  "use strict";
  var figures = document.querySelectorAll("figure.plot[data-chart]");
  var drawn = 0;
  figures.forEach(function (figure) {
    var shapes = figure.querySelectorAll("svg .series");
    var visible = 0;
    shapes.forEach(function (shape) {
      var box = shape.getBBox();
      if (box.width > 0 || box.height > 0) { visible += 1; }
    });
    if (visible > 0) {
      figure.dataset.drawn = String(visible);
      drawn += 1;
    }
    figure.querySelectorAll("button.key").forEach(function (key) {
      key.addEventListener("click", function () {
        var off = key.classList.toggle("off");
        figure.querySelectorAll('svg .series[data-series="' + key.dataset.series + '"]').forEach(function (s) {
          s.style.display = off ? "none" : "";
        });
      });
    });
  });
  // The x axis of the training charts: by step (as TensorBoard and W&B draw it) or by wall time.
  document.querySelectorAll(".axis-toggle button").forEach(function (button) {
    button.addEventListener("click", function () {
      var axis = button.dataset.axis;
      document.body.classList.toggle("by-step", axis === "step");
      document.body.classList.toggle("by-time", axis === "time");
      document.querySelectorAll(".axis-toggle button").forEach(function (other) {
        other.classList.toggle("on", other.dataset.axis === axis);
      });
    });
  });
  if (window.location.hash === "#by-time") {
    var byTime = document.querySelector('.axis-toggle button[data-axis="time"]');
    if (byTime) { byTime.click(); }
  }
  document.body.dataset.drawn = String(drawn);
})();
