//! Loading: the built-in defaults, `default.toml`, `{INBOX_ENV}.toml`, then
//! the `INBOX__SECTION__KEY` environment, later layers winning.

use std::collections::HashMap;
use std::path::Path;

use super::{Settings, ValidSettings};
use crate::error::{Error, Result};

impl Settings {
    /// Loads `default.toml`, `{INBOX_ENV}.toml` and the
    /// `INBOX__SECTION__KEY` environment over the built-in defaults, and
    /// validates the result. The files are in `INBOX_CONFIG_DIR`, or in
    /// `config/` under the working directory. Which files were read is
    /// logged at INFO (and a folder without any at WARN): a service started
    /// elsewhere must not run on the defaults unnoticed.
    pub fn load() -> Result<ValidSettings> {
        Self::load_from(&config_dir(std::env::var_os("INBOX_CONFIG_DIR")))
    }

    /// Like [`Settings::load`], with the settings files in `dir`.
    pub fn load_from(dir: &Path) -> Result<ValidSettings> {
        let inbox_env = std::env::var("INBOX_ENV").ok().filter(|e| !e.is_empty());
        Self::load_layered(dir, inbox_env.as_deref(), None, false)
    }

    /// Like [`Settings::load_from`], for the environment named `inbox_env`
    /// whatever `INBOX_ENV` says (tests load `config/test.toml` this way).
    pub fn load_environment(dir: &Path, inbox_env: &str) -> Result<ValidSettings> {
        Self::load_layered(dir, Some(inbox_env), None, false)
    }

    /// Like [`Settings::load`], with the conventional `DATABASE_URL` and
    /// `AMQP_URL` environment variables, where set, as the examples honour
    /// them: `DATABASE_URL` replaces `database.url` (a `database.name` of
    /// an earlier version names a database in it, as it did); `AMQP_URL`
    /// replaces `message_bus.amqp_urls` unless they list the nodes of a
    /// cluster (two or more).
    pub fn load_with_conventional_urls() -> Result<ValidSettings> {
        let dir = config_dir(std::env::var_os("INBOX_CONFIG_DIR"));
        let inbox_env = std::env::var("INBOX_ENV").ok().filter(|e| !e.is_empty());
        Self::load_layered(&dir, inbox_env.as_deref(), None, true)
    }

    /// The layering itself, with the conventional URLs when
    /// `conventional`; `vars` replaces the process environment (tests).
    pub(super) fn load_layered(
        dir: &Path,
        inbox_env: Option<&str>,
        vars: Option<HashMap<String, String>>,
        conventional: bool,
    ) -> Result<ValidSettings> {
        let var = |name: &str| match &vars {
            Some(vars) => vars.get(name).cloned(),
            None => std::env::var(name).ok(),
        };
        let database_url = conventional.then(|| var("DATABASE_URL")).flatten();
        let amqp_url = conventional.then(|| var("AMQP_URL")).flatten();
        use config::{Config, Environment, File};
        let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
        // Each layer read on its own, so that an old spelling can be
        // weighed against the new one by the layer that set it.
        let layer = |source| Config::builder().add_source(source).build();
        // default.toml is optional (the built-in defaults are the same values);
        // a named environment whose file is missing is a mistake worth stopping for.
        let mut layers =
            vec![layer(File::with_name(&path("default")).required(false)).map_err(Error::client)?];
        let mut files: Vec<String> = Some(dir.join("default.toml"))
            .filter(|file| file.is_file())
            .map(|file| file.display().to_string())
            .into_iter()
            .collect();
        if let Some(env) = inbox_env {
            layers.push(layer(File::with_name(&path(env)).required(true)).map_err(Error::client)?);
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
        layers.push(
            Config::builder()
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
                .map_err(Error::client)?,
        );
        let old = OldSpellings::of(&layers)?;
        let layered = layers
            .into_iter()
            .fold(Config::builder(), |builder, layer| builder.add_source(layer))
            .build()
            .map_err(Error::client)?;
        let mut tree = config::Source::collect(&layered).map_err(Error::client)?;
        OldSpellings::remove(&mut tree);
        let mut settings: Settings = config::Value::from(tree)
            .try_deserialize()
            .map_err(Error::client)?;
        // DATABASE_URL replaces the url before an old `database.name` is
        // written into it, as that name replaced the one in DATABASE_URL.
        if let Some(url) = database_url {
            settings.database.url = url;
        }
        old.apply(&mut settings)?;
        // AMQP_URL replaces one broker (an old `amqp_url` too), but not the
        // nodes of a cluster, which one URL cannot describe.
        if let Some(url) = amqp_url
            && settings.message_bus.amqp_urls.len() < 2
        {
            settings.message_bus.amqp_urls = vec![url];
        }
        settings.validate()
    }
}

/// The spellings earlier versions read, still honoured so that an existing
/// settings file or environment keeps meaning what it meant, each with a
/// WARN naming the key that replaces it:
/// - `message_bus.amqp_url`, one broker: read as `amqp_urls`, a list of
///   one, when the last layer that sets either sets it (a layer that sets
///   both means its `amqp_urls`, as before, unless that list is empty);
/// - `database.name`: written into `database.url`, whichever layer set it;
/// - `message_bus.amqp_urls = []`, which meant "`amqp_url` alone": the
///   default broker, unless `amqp_url` names one.
struct OldSpellings {
    amqp_url: OldBroker,
    database_name: Option<String>,
}

/// What becomes of a `message_bus.amqp_url`.
#[derive(PartialEq)]
enum OldBroker {
    /// No layer sets it.
    Unset,
    /// It names the broker: no later layer, nor its own, lists `amqp_urls`.
    Read(String),
    /// `amqp_urls`, in its layer or a later one, names the brokers instead.
    Ignored,
}

impl OldSpellings {
    /// What the old keys say in `layers`, earliest first.
    fn of(layers: &[config::Config]) -> Result<Self> {
        let text = |layer: &config::Config, key: &str| -> Result<Option<String>> {
            match layer.get::<Option<String>>(key) {
                Ok(text) => Ok(text),
                Err(config::ConfigError::NotFound(_)) => Ok(None),
                Err(e) => Err(Error::setting(key, e.to_string())),
            }
        };
        let lists_brokers = |layer: &config::Config| {
            layer
                .get::<config::Value>("message_bus.amqp_urls")
                .is_ok_and(|urls| urls.into_array().map_or(true, |urls| !urls.is_empty()))
        };
        let mut old = Self {
            amqp_url: OldBroker::Unset,
            database_name: None,
        };
        for layer in layers {
            let url = text(layer, "message_bus.amqp_url")?;
            old.amqp_url = match (url, lists_brokers(layer)) {
                (Some(url), false) => OldBroker::Read(url),
                (Some(_), true) => OldBroker::Ignored,
                (None, true) if old.amqp_url != OldBroker::Unset => OldBroker::Ignored,
                (None, _) => old.amqp_url,
            };
            if let Some(name) = text(layer, "database.name")? {
                old.database_name = Some(name);
            }
        }
        Ok(old)
    }

    /// Takes the old keys out of the layered `tree`, so that what remains
    /// reads as [`Settings`] (which refuses unknown keys), and an empty
    /// `amqp_urls`, so that the default applies.
    fn remove(tree: &mut config::Map<String, config::Value>) {
        let always = |_: &config::Value| true;
        let empty = |value: &config::Value| value.clone().into_array().is_ok_and(|list| list.is_empty());
        remove_key(tree, "message_bus", "amqp_url", always);
        remove_key(tree, "database", "name", always);
        remove_key(tree, "message_bus", "amqp_urls", empty);
    }

    /// Applies what the old keys said to `settings`, read without them.
    fn apply(self, settings: &mut Settings) -> Result<()> {
        if let OldBroker::Read(url) = self.amqp_url {
            url.parse::<lapin::uri::AMQPUri>()
                .map_err(|e| Error::setting("message_bus.amqp_url", format!("not an AMQP URL: {e}")))?;
            tracing::warn!(
                "message_bus.amqp_url is read as message_bus.amqp_urls, a list of one: \
                 rename it, amqp_url will not be read in a later version"
            );
            settings.message_bus.amqp_urls = vec![url];
        } else if self.amqp_url == OldBroker::Ignored {
            tracing::warn!(
                "message_bus.amqp_url is ignored: message_bus.amqp_urls, set in the same or a later layer, \
                 names the brokers"
            );
        }
        if let Some(name) = self.database_name {
            if name.is_empty() {
                return Err(Error::setting(
                    "database.name",
                    "is empty; leave it unset to use the url's database",
                ));
            }
            settings.database.set_dbname(&name)?;
            tracing::warn!(
                database = %name,
                "database.name is written into database.url: name the database there \
                 (postgres://host/{name}); database.name will not be read in a later version"
            );
        }
        Ok(())
    }
}

/// Removes `section.key` from `tree` if its value passes `when`.
fn remove_key(
    tree: &mut config::Map<String, config::Value>,
    section: &str,
    key: &str,
    when: impl Fn(&config::Value) -> bool,
) {
    if let Some(table) = tree.get_mut(section)
        && let Ok(mut entries) = table.clone().into_table()
        && entries.get(key).is_some_and(when)
    {
        entries.remove(key);
        *table = config::Value::from(entries);
    }
}

/// The settings folder: `INBOX_CONFIG_DIR` when set, else `config`.
pub(super) fn config_dir(variable: Option<std::ffi::OsString>) -> std::path::PathBuf {
    variable
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| "config".into(), Into::into)
}
