"""The rows of server-{before,after}SUFFIX.json side by side: value (ratio to Redis). argv: SUFFIX..."""
import json
import sys

for s in sys.argv[1:]:
    got = {}
    for w in ("before", "after"):
        rows = json.load(open(f"server-{w}{s}.json"))
        rows = rows["rows"] if isinstance(rows, dict) else rows
        for r in rows:
            got.setdefault(r["metric"], {})[w] = r
    print(f"== sitting {s}")
    for metric, by in got.items():
        cells = []
        for w in ("before", "after"):
            r = by.get(w)
            cells.append("-" if r is None else f"{r['value']:.3g} ({r['ratio']:.2f}x)" if r.get("ratio") else f"{r['value']:.3g}")
        print(f"  {metric[:62]:62s} {cells[0]:>18s} {cells[1]:>18s}")
