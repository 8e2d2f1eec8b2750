// A Zero 1.9.0 client (Node, in-memory store) against the view-syncer on 127.0.0.1:$ZERO_PORT.
// Materializes public.issues; prints one JSON line {updates, rows} after $CLIENT_SECONDS seconds.
import { WebSocket } from "ws";

globalThis.WebSocket = WebSocket;
const { Zero, createSchema, table, string, number } = await import("@rocicorp/zero");
const issues = table("issues")
  .columns({
    id: string(),
    title: string().optional(),
    status: string().optional(),
    priority: number().optional(),
    modified: number().optional(),
  })
  .primaryKey("id");
const schema = createSchema({ tables: [issues], enableLegacyQueries: true, enableLegacyMutators: true });
const z = new Zero({
  server: `http://127.0.0.1:${process.env.ZERO_PORT ?? 4858}`,
  schema,
  userID: "anon",
  kvStore: "mem",
  logLevel: "error",
});
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
