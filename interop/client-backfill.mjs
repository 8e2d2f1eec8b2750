// A Zero 1.9.0 client (Node, in-memory store) for run-pg's backfill step, against the
// view-syncer on 127.0.0.1:$ZERO_PORT.
//   CLIENT_SCHEMA=old  issues(id, title, status, priority, modified): a client from before
//                      the schema change, connected while the backfill runs
//   CLIENT_SCHEMA=new  issues + due (timestamptz) + score (float8), and labels = the
//                      upstream table extra.labels (id, name, weight)
// Stages: run-pg writes $EXPECT_DIR/expect-1.json, expect-2.json, ... (what upstream holds:
// {"issues": {id: {col: value}}, "labels": {id: {col: value}}}, timestamps as epoch ms);
// for each, this client waits until the rows it materializes equal the expected ones (in
// the columns its schema has) and prints "matched N", or after $STAGE_SECONDS prints
// "mismatch N: <the differences>" and exits 1. $EXPECT_DIR/done ends it (exit 0).
import { existsSync, readFileSync } from "node:fs";
import { connect, issueColumns as columnsOfIssues, number, string, table } from "./zero-client.mjs";

const which = process.env.CLIENT_SCHEMA ?? "new";
const dir = process.env.EXPECT_DIR;
const stageMs = Number(process.env.STAGE_SECONDS ?? 60) * 1000;
const name = `client-${which}`;

const issueColumns = columnsOfIssues();
if (which === "new") {
  issueColumns.due = number().optional();
  issueColumns.score = number().optional();
}
const tables = [table("issues").columns(issueColumns).primaryKey("id")];
if (which === "new") {
  tables.push(
    table("labels")
      .from("extra.labels")
      .columns({ id: string(), name: string().optional(), weight: number().optional() })
      .primaryKey("id"),
  );
}
const z = connect(tables);

// The stage being waited for and what it expects (null: waiting for its file).
let stage = 1;
let expected = null;
let deadline = 0;

// Current rows by table, and how many times each view changed.
const current = {};
const updates = {};
for (const t of tables.map((b) => b.build().name)) {
  current[t] = [];
  updates[t] = 0;
  z.query[t].materialize().addListener((rows) => {
    current[t] = rows;
    updates[t]++;
    check();
  });
}

// Columns compared with a tolerance: timestamps go through floats on both sides.
const TOLERANCE = { due: 0.001 };

function differences(expected) {
  const out = [];
  let count = 0;
  for (const t of Object.keys(current)) {
    const [before, at] = [count, out.length];
    const want = expected[t] ?? {};
    const cols = Object.keys(tables.find((b) => b.build().name === t).build().columns).filter((c) => c !== "id");
    const have = new Map(current[t].map((r) => [r.id, r]));
    for (const [id, row] of Object.entries(want)) {
      const got = have.get(id);
      if (!got) {
        if (count++ < 8) out.push(`${t} ${id}: missing (expected ${JSON.stringify(row)})`);
        continue;
      }
      for (const c of cols) {
        const w = row[c] ?? null;
        const g = got[c] ?? null;
        const same =
          w === g || (typeof w === "number" && typeof g === "number" && Math.abs(w - g) <= (TOLERANCE[c] ?? 0));
        if (!same && count++ < 8) out.push(`${t} ${id}.${c}: got ${JSON.stringify(g)}, expected ${JSON.stringify(w)}`);
      }
    }
    for (const id of have.keys()) {
      if (!(id in want) && count++ < 8) out.push(`${t} ${id}: not upstream`);
    }
    if (count > before) out.splice(at, 0, `${t}: ${current[t].length} rows seen, ${Object.keys(want).length} upstream`);
  }
  return count ? `${count} differences: ${out.join("; ")}` : "";
}

function check() {
  if (!expected) return;
  const diff = differences(expected);
  if (!diff) {
    console.log(`${name}: matched ${stage} (views changed ${JSON.stringify(updates)} times)`);
    stage++;
    expected = null;
    poll();
  } else if (Date.now() > deadline) {
    console.log(`${name}: mismatch ${stage}: ${diff}`);
    process.exit(1);
  }
}

function poll() {
  if (!expected) {
    const file = `${dir}/expect-${stage}.json`;
    if (existsSync(file)) {
      expected = JSON.parse(readFileSync(file, "utf8"));
      deadline = Date.now() + stageMs;
      check();
    } else if (existsSync(`${dir}/done`)) {
      clearInterval(timer);
      z.close().finally(() => process.exit(0));
    }
  } else {
    check();
  }
}
const timer = setInterval(poll, 200);
