// What the interop clients share: Zero 1.9.0 in Node (the ws WebSocket, an in-memory
// store) against the view-syncer on 127.0.0.1:$ZERO_PORT, and the issues table's columns.
import { WebSocket } from "ws";

globalThis.WebSocket = WebSocket;
export const { Zero, createSchema, table, string, number } = await import("@rocicorp/zero");

// public.issues as the interop scripts create it.
export function issueColumns() {
  return {
    id: string(),
    title: string().optional(),
    status: string().optional(),
    priority: number().optional(),
    modified: number().optional(),
  };
}

// A client of the view-syncer over `tables` (table builders).
export function connect(tables) {
  const schema = createSchema({ tables, enableLegacyQueries: true, enableLegacyMutators: true });
  return new Zero({
    server: `http://127.0.0.1:${process.env.ZERO_PORT ?? 4858}`,
    schema,
    userID: "anon",
    kvStore: "mem",
    logLevel: "error",
  });
}
