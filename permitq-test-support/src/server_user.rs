//! Running the servers a test bed starts (PgBouncer, etcd, Patroni) as the OS user PostgreSQL
//! runs as ([`permitq_embedded_pg::server_user`]: `postgres` when the tests run as root).

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// Makes `cmd` run as the server user, and hands it `dir`, where the server writes.
pub(crate) fn as_server_user(cmd: &mut Command, dir: &Path) {
    let user = permitq_embedded_pg::server_user().expect("the OS user servers run as");
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .expect("hand the bed's directory to the server user");
        cmd.uid(uid).gid(gid);
    }
}
