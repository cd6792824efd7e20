//! Loading: the built-in defaults, `default.toml`, `{INBOX_ENV}.toml`, then
//! the `INBOX__SECTION__KEY` environment, later layers winning.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};

use super::{Settings, ValidSettings};

impl Settings {
    /// Loads `default.toml`, `{INBOX_ENV}.toml` and the
    /// `INBOX__SECTION__KEY` environment over the built-in defaults, and
    /// validates the result. The files are in `INBOX_CONFIG_DIR`, or in
    /// `config/` under the working directory. Which files were read is
    /// logged at INFO (and a folder without any at WARN): a service started
    /// elsewhere must not run on the defaults unnoticed.
    ///
    /// The one way to load. To change what was loaded in code, use
    /// [`ValidSettings::with`], which validates again.
    pub fn load() -> Result<ValidSettings> {
        let inbox_env = std::env::var("INBOX_ENV").ok().filter(|e| !e.is_empty());
        Self::load_layered(
            &config_dir(std::env::var_os("INBOX_CONFIG_DIR")),
            inbox_env.as_deref(),
            None,
        )
    }

    /// The layering itself, from the files in `dir` and the environment
    /// named `inbox_env`; `vars` replaces the process environment (tests).
    pub(crate) fn load_layered(
        dir: &Path,
        inbox_env: Option<&str>,
        vars: Option<HashMap<String, String>>,
    ) -> Result<ValidSettings> {
        use config::{Config, Environment, File};
        let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
        // default.toml is optional (the built-in defaults are the same values);
        // a named environment whose file is missing is a mistake worth stopping for.
        let mut builder = Config::builder().add_source(File::with_name(&path("default")).required(false));
        let mut files: Vec<String> = Some(dir.join("default.toml"))
            .filter(|file| file.is_file())
            .map(|file| file.display().to_string())
            .into_iter()
            .collect();
        if let Some(env) = inbox_env {
            builder = builder.add_source(File::with_name(&path(env)).required(true));
            files.push(dir.join(format!("{env}.toml")).display().to_string());
        }
        if files.is_empty() {
            let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
            tracing::warn!(
                dir = %dir.display(),
                "no settings file found (set INBOX_CONFIG_DIR to the folder that holds default.toml): \
                 running on the built-in defaults and INBOX__ variables"
            );
        } else {
            tracing::info!(files = %files.join(", "), "settings loaded");
        }
        let settings: Settings = builder
            .add_source(
                Environment::with_prefix("INBOX")
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true)
                    .list_separator(",")
                    .with_list_parse_key("failure.delays")
                    .with_list_parse_key("message_bus.amqp_urls")
                    .source(vars),
            )
            .build()
            .and_then(Config::try_deserialize)
            .map_err(Error::client)?;
        settings.validate()
    }
}

/// The settings folder: `INBOX_CONFIG_DIR` when set, else `config`.
pub(super) fn config_dir(variable: Option<std::ffi::OsString>) -> std::path::PathBuf {
    variable
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| "config".into(), Into::into)
}
