//! Connecting a service to Postgres: the database is created when it does not exist, the
//! service's own schema is created and put first on the search path, and the service's
//! migrations are applied.

use std::str::FromStr;

use sqlx::migrate::{MigrateDatabase, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

/// A pool on `url` whose connections work in `schema` (lowercase letters and `_`), after
/// `migrator` has run there.
pub async fn connect(url: &str, schema: &str, migrator: &Migrator) -> Result<PgPool, String> {
    if schema.is_empty() || !schema.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
        return Err(format!("schema `{schema}`: lowercase letters and `_` only"));
    }
    if !Postgres::database_exists(url).await.map_err(|e| format!("cannot reach Postgres at {url}: {e}"))? {
        Postgres::create_database(url).await.map_err(|e| format!("cannot create the database {url}: {e}"))?;
    }
    let options =
        PgConnectOptions::from_str(url).map_err(|e| format!("database_url: {e}"))?.options([("search_path", schema)]);
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot connect to Postgres at {url}: {e}"))?;
    // The name was checked above: only letters and `_` reach the statement.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS {schema}")))
        .execute(&pool)
        .await
        .map_err(|e| format!("cannot create schema {schema}: {e}"))?;
    migrator.run(&pool).await.map_err(|e| format!("migrations failed: {e}"))?;
    Ok(pool)
}
