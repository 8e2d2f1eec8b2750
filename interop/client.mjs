// A Zero 1.9.0 client (Node, in-memory store) against the view-syncer on 127.0.0.1:$ZERO_PORT.
// Materializes public.issues; prints one JSON line {updates, rows} after $CLIENT_SECONDS seconds.
import { connect, issueColumns, table } from "./zero-client.mjs";

const z = connect([table("issues").columns(issueColumns()).primaryKey("id")]);
let updates = 0;
let rows = 0;
z.query.issues.materialize().addListener((r) => {
  updates++;
  rows = r.length;
});
setTimeout(() => {
  console.log(JSON.stringify({ updates, rows }));
  process.exit(0);
}, Number(process.env.CLIENT_SECONDS ?? 10) * 1000);
