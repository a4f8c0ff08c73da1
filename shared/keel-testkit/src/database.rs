//! A database of the test's own on the real Postgres, dropped (with `FORCE`) when the guard
//! goes. `KEEL_TEST_POSTGRES` names the server (default postgres://postgres@127.0.0.1:5432).

/// The server's URL without a database.
pub fn postgres_url() -> String {
    std::env::var("KEEL_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

/// A unique database name; services create it on first connect.
#[derive(Debug)]
pub struct TestDatabase {
    pub url: String,
    name: String,
}

impl TestDatabase {
    /// A fresh name starting with `prefix` (letters, digits and `_`).
    pub fn new(prefix: &str) -> Self {
        let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
        Self { url: format!("{}/{name}", postgres_url()), name }
    }

    /// The database's URL through another `host:port` (a proxy in front of the server).
    pub fn url_at(&self, addr: &str) -> String {
        let server = postgres_url();
        let user = server.rsplit_once('@').map_or("postgres://", |(user, _)| user);
        let user = if user.ends_with("://") { user.to_string() } else { format!("{user}@") };
        format!("{user}{addr}/{}", self.name)
    }
}

/// The Postgres server's `host:port` (from [`postgres_url`]).
pub fn postgres_addr() -> String {
    let server = postgres_url();
    let rest = server.split_once("://").map_or(server.as_str(), |(_, rest)| rest);
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    host.split('/').next().unwrap_or(host).to_string()
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        let admin = format!("{}/postgres", postgres_url());
        // The test's runtime may be shutting down: drop the database from a thread of our own.
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            runtime.block_on(async {
                use sqlx::Connection;
                if let Ok(mut conn) = sqlx::PgConnection::connect(&admin).await {
                    let drop = sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
                    let _ = sqlx::query(drop).execute(&mut conn).await;
                }
            })
        })
        .join();
    }
}
