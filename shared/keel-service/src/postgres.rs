//! Connecting a service to Postgres: the database is created when it does not exist, the
//! service's own schema is created and put first on the search path, and the service's
//! migrations are applied.

use std::str::FromStr;

use sqlx::migrate::{MigrateDatabase, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::error::PostgresError;

/// A pool on `url` whose connections work in `schema` (lowercase letters and `_`), after
/// `migrator` has run there.
pub async fn connect(url: &str, schema: &str, migrator: &Migrator) -> Result<PgPool, PostgresError> {
    if schema.is_empty() || !schema.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
        return Err(PostgresError::InvalidSchema(schema.to_string()));
    }
    let failed = |doing: String| move |source| PostgresError::Failed { doing, source };
    if !Postgres::database_exists(url).await.map_err(failed(format!("cannot reach Postgres at {url}")))? {
        Postgres::create_database(url).await.map_err(failed(format!("cannot create the database {url}")))?;
    }
    let options =
        PgConnectOptions::from_str(url).map_err(PostgresError::InvalidUrl)?.options([("search_path", schema)]);
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await
        .map_err(failed(format!("cannot connect to Postgres at {url}")))?;
    // The name was checked above: only letters and `_` reach the statement.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS {schema}")))
        .execute(&pool)
        .await
        .map_err(failed(format!("cannot create schema {schema}")))?;
    migrator.run(&pool).await?;
    Ok(pool)
}
