/** What the client refuses before it sends anything: a URL it cannot use, options it does not know. */

import { InvalidInput } from "./errors.js";

const FORM =
  "expected postgres://user[:password]@host[:port]/database (e.g. postgres://app@localhost:5432/app, " +
  "or postgres:///app for the local socket)";

const SSLMODES = ["disable", "prefer", "require", "verify-ca", "verify-full", "no-verify"];

/**
 * A connection string node-postgres would misread: another scheme or none (node-postgres takes
 * `localhost/app` as a socket path and connects to its defaults), a URL that does not parse (its
 * TypeError says only "Invalid URL"), a port that is not a number, an unknown sslmode.
 */
export function checkUrl(connectionString: string): void {
  const invalid = (what: string) => new InvalidInput(`invalid database URL: ${what}: ${FORM}`, "database URL");
  // Empty: node-postgres's defaults (PGHOST, PGUSER, ...), as libpq's.
  if (connectionString.trim() === "") return;
  const scheme = /^([a-z][a-z0-9+.-]*):\/\//i.exec(connectionString)?.[1];
  if (scheme === undefined) {
    throw invalid(`${JSON.stringify(connectionString)} has no scheme`);
  }
  if (!["postgres", "postgresql"].includes(scheme.toLowerCase())) {
    throw invalid(`${scheme}:// is not PostgreSQL's scheme: use postgres://`);
  }
  const authority = connectionString.slice(scheme.length + 3).split(/[/?]/)[0] ?? "";
  if ((authority.match(/@/g) ?? []).length > 1) {
    throw invalid(
      "a password (or user name) with an @, :, / or # in it must be percent-encoded in the URL " +
        "(@ as %40, : as %3A, / as %2F, # as %23)",
    );
  }
  // A Unix socket in the query (`postgres://me@/app?host=/run/postgresql`): an empty host,
  // which WHATWG URL refuses with credentials and node-postgres reads.
  if (authority.endsWith("@")) return;
  let url: URL;
  try {
    url = new URL(connectionString);
    decodeURIComponent(url.username);
    decodeURIComponent(url.password);
  } catch {
    throw invalid(
      "it does not parse (a password with @, :, /, # or % in it must be percent-encoded: @ as %40, " +
        ": as %3A, / as %2F, # as %23, % as %25)",
    );
  }
  const port = url.searchParams.get("port");
  if (port !== null && !/^\d+$/.test(port)) {
    throw invalid(`port ${JSON.stringify(port)} is not a number`);
  }
  const sslmode = url.searchParams.get("sslmode");
  if (sslmode !== null && !SSLMODES.includes(sslmode)) {
    throw invalid(`sslmode ${JSON.stringify(sslmode)} is not one of ${SSLMODES.join(", ")}`);
  }
}

/** What each option must be: a number of seconds, a whole number, a string or a signal. */
type Kind = "seconds" | "integer" | "string" | "signal";

const KINDS: Record<string, Kind> = {
  owner: "string",
  ttlSeconds: "seconds",
  waitSeconds: "seconds",
  priority: "integer",
  fairnessKey: "string",
  fairnessWeight: "integer",
  timeoutMs: "seconds",
  pollMs: "seconds",
  signal: "signal",
};

/** The option a caller from another client most likely meant. */
const MEANT: Record<string, string> = {
  ttl: "ttlSeconds",
  ttlMs: "ttlSeconds (seconds)",
  lease: "ttlSeconds",
  wait: "waitSeconds",
  waitMs: "waitSeconds (seconds)",
  timeout: "timeoutMs",
  timeoutSeconds: "timeoutMs (milliseconds)",
  deadline: "timeoutMs",
  abortSignal: "signal",
};

/**
 * Options checked before anything is sent: an unknown name (a misspelling would be ignored
 * silently, `ttl: 30` leaving the request without a lease), or a value of the wrong kind (`"30s"`
 * would reach SQL). `allowed`: the names this call takes.
 */
export function checkOptions(options: object, allowed: readonly string[]): void {
  for (const [name, value] of Object.entries(options)) {
    if (!allowed.includes(name)) {
      const meant = MEANT[name];
      const known = allowed.filter((a) => a !== "signal").join(", ");
      throw new InvalidInput(
        `invalid option ${name}: ${meant ? `did you mean ${meant}? ` : ""}this call takes ${known}` +
          (allowed.includes("signal") ? " and signal" : ""),
        name,
      );
    }
    if (value === undefined || value === null) continue;
    const kind = KINDS[name];
    const bad =
      kind === "seconds"
        ? typeof value !== "number" || !Number.isFinite(value) || value < 0
        : kind === "integer"
          ? !Number.isInteger(value)
          : kind === "string"
            ? typeof value !== "string"
            : !(value instanceof AbortSignal);
    if (bad) {
      const want =
        kind === "seconds"
          ? `a non-negative number (${name.endsWith("Ms") ? "milliseconds, e.g. 30000" : "seconds, e.g. 30"})`
          : kind === "integer"
            ? "a whole number"
            : kind === "string"
              ? "a string"
              : "an AbortSignal";
      throw new InvalidInput(`invalid ${name}: must be ${want}, got ${JSON.stringify(value) ?? String(value)}`, name);
    }
  }
}

/**
 * The external_id, checked before anything is sent: called from plain JavaScript without it
 * (`withLease(client, { gpu: 1 }, ...)`), the permits would be taken as the id and the options
 * as the permits, and the answer would name an option as an unknown semaphore.
 */
export function checkExternalId(externalId: unknown): void {
  if (typeof externalId !== "string" || externalId.length === 0) {
    const got = typeof externalId === "string" ? "an empty string" : `${JSON.stringify(externalId) ?? String(externalId)}`;
    throw new InvalidInput(
      `invalid externalId: the request's id, chosen by you, comes first, before the permits ` +
        `(e.g. acquire("job-1", { gpu: 1 }) or withLease(client, "job-1", { gpu: 1 }, options, work)); got ${got}`,
      "externalId",
    );
  }
}

/** The options `submit` takes. */
export const SUBMIT_OPTIONS = ["owner", "ttlSeconds", "waitSeconds", "priority", "fairnessKey", "fairnessWeight"] as const;
/** The options `acquire` takes. */
export const ACQUIRE_OPTIONS = [...SUBMIT_OPTIONS, "timeoutMs", "signal"] as const;

/**
 * A client config that names no database: no connectionString, host or user, and none of
 * libpq's variables (node-postgres would try localhost as no user), or a connectionString
 * misspelled (`connectionstring`).
 */
export function checkConfig(config: Record<string, unknown>): void {
  const misspelled = Object.keys(config).find((k) => k !== "connectionString" && k.toLowerCase() === "connectionstring");
  if (misspelled) {
    throw new InvalidInput(`invalid option ${misspelled}: did you mean connectionString?`, misspelled);
  }
  const env = ["PGHOST", "PGUSER", "PGDATABASE"].some((v) => process.env[v]);
  if (typeof config.connectionString === "string" && config.connectionString.trim() === "" &&
      config.host === undefined && config.user === undefined && !env) {
    // node-postgres would try its defaults (localhost as this OS user): almost always an
    // environment variable set but empty.
    throw new InvalidInput(
      "invalid database URL: it is empty, and no PGHOST, PGUSER or PGDATABASE is set (is DATABASE_URL set but empty?): " +
        "expected postgres://user[:password]@host[:port]/database",
      "database URL",
    );
  }
  if (config.connectionString === undefined && config.host === undefined && config.user === undefined && !env) {
    throw new InvalidInput(
      "no database given: pass connectionString (e.g. process.env.DATABASE_URL, if it is set: " +
        "postgres://user[:password]@host[:port]/database), or host and user, or set PGHOST and PGUSER",
      "connectionString",
    );
  }
}
