// A Zero 1.9.0 client (Node, in-memory store) against the view-syncer on 127.0.0.1:$ZERO_PORT
// while the replication-manager behind it is replaced. Materializes public.issues and
// notes when each written row 'w<n>' (n = 1..$EXPECTED) first appears. Prints one JSON
// line when it has seen them all or after $CLIENT_SECONDS seconds:
//   {seen, missing: [first few], rows, maxGapMs, gaps: [the 3 largest, ms]}
// where a gap is the time between two consecutive rows becoming visible (the writer
// commits one every 1/$RATE s, so a gap much longer than that is the handoff's).
import { connect, issueColumns, table } from "./zero-client.mjs";

const z = connect([table("issues").columns(issueColumns()).primaryKey("id")]);
const expected = Number(process.env.EXPECTED ?? 100);
const firstSeen = new Map(); // n -> ms
let rows = 0;

function report() {
  const times = [...firstSeen.entries()].sort((a, b) => a[0] - b[0]).map(([, t]) => t);
  times.sort((a, b) => a - b);
  const gaps = [];
  for (let i = 1; i < times.length; i++) gaps.push(Math.round(times[i] - times[i - 1]));
  gaps.sort((a, b) => b - a);
  const missing = [];
  for (let n = 1; n <= expected && missing.length < 10; n++) if (!firstSeen.has(n)) missing.push(n);
  console.log(
    JSON.stringify({ seen: firstSeen.size, missing, rows, maxGapMs: gaps[0] ?? 0, gaps: gaps.slice(0, 3) }),
  );
  process.exit(0);
}

z.query.issues.materialize().addListener((r) => {
  rows = r.length;
  const now = performance.now();
  for (const row of r) {
    if (!row.id.startsWith("w")) continue;
    const n = Number(row.id.slice(1));
    if (!firstSeen.has(n)) firstSeen.set(n, now);
  }
  if (firstSeen.size >= expected) report();
});
setTimeout(report, Number(process.env.CLIENT_SECONDS ?? 60) * 1000);
