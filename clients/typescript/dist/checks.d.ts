/** What the client refuses before it sends anything: a URL it cannot use, options it does not know. */
/**
 * A connection string node-postgres would misread: another scheme or none (node-postgres takes
 * `localhost/app` as a socket path and connects to its defaults), a URL that does not parse (its
 * TypeError says only "Invalid URL"), a port that is not a number, an unknown sslmode.
 */
export declare function checkUrl(connectionString: string): void;
/**
 * Options checked before anything is sent: an unknown name (a misspelling would be ignored
 * silently, `ttl: 30` leaving the request without a lease), or a value of the wrong kind (`"30s"`
 * would reach SQL). `allowed`: the names this call takes.
 */
export declare function checkOptions(options: object, allowed: readonly string[]): void;
/**
 * The external_id, checked before anything is sent: called from plain JavaScript without it
 * (`withLease(client, { gpu: 1 }, ...)`), the permits would be taken as the id and the options
 * as the permits, and the answer would name an option as an unknown semaphore.
 */
export declare function checkExternalId(externalId: unknown): void;
/** The options `submit` takes. */
export declare const SUBMIT_OPTIONS: readonly ["owner", "ttlSeconds", "waitSeconds", "priority", "fairnessKey", "fairnessWeight"];
/** The options `acquire` takes. */
export declare const ACQUIRE_OPTIONS: readonly ["owner", "ttlSeconds", "waitSeconds", "priority", "fairnessKey", "fairnessWeight", "timeoutMs", "signal"];
/**
 * A client config that names no database: no connectionString, host or user, and none of
 * libpq's variables (node-postgres would try localhost as no user), or a connectionString
 * misspelled (`connectionstring`).
 */
export declare function checkConfig(config: Record<string, unknown>): void;
