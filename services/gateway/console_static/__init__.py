"""The console's page, script and style sheet, and the chart library it draws with
(uPlot, MIT, vendored under vendor/uplot/ with its licence): served by console.py."""
