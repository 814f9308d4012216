//! TLS to a shard: the `tls:` section of its config as mysql_async's connection options.

use mysql_async::OptsBuilder;
use shardlock_core::config::{TlsConfig, TlsMode};
use shardlock_core::ConfigError;

/// `opts` with TLS as `tls` asks (the shard at `index` of `shards`, for errors). Files are
/// checked here, so that a missing one is a config error naming its field, not a failure of
/// every connection.
pub(crate) fn apply(
    opts: OptsBuilder,
    tls: &TlsConfig,
    index: usize,
) -> Result<OptsBuilder, ConfigError> {
    if tls.mode == TlsMode::Disabled {
        return Ok(opts);
    }
    for (name, file) in [
        ("ca-file", &tls.ca_file),
        ("cert-file", &tls.cert_file),
        ("key-file", &tls.key_file),
    ] {
        if let Some(path) = file {
            std::fs::metadata(path).map_err(|e| {
                ConfigError::field(
                    format!("shards[{index}].tls.{name}"),
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
        }
    }
    ssl(opts, tls, index)
}

#[cfg(feature = "tls")]
fn ssl(opts: OptsBuilder, tls: &TlsConfig, index: usize) -> Result<OptsBuilder, ConfigError> {
    use mysql_async::{ClientIdentity, SslOpts};
    if tls.mode == TlsMode::VerifyCa {
        // mysql_async 0.37 tells a name mismatch from other failures by the text of rustls'
        // error, which rustls no longer writes so: the name is checked whatever it is told
        // (blackbeam/mysql_async#404, fixed upstream after 0.37.1).
        return Err(ConfigError::field(
            format!("shards[{index}].tls.mode"),
            "verify-ca is not available in this version (its MySQL driver checks the host name \
             anyway): use verify-identity, with `server-name` when the certificate is issued for \
             another name than the URL's host",
        ));
    }
    let check_chain = matches!(tls.mode, TlsMode::VerifyCa | TlsMode::VerifyIdentity);
    let mut ssl = SslOpts::default()
        .with_danger_accept_invalid_certs(!check_chain)
        .with_danger_skip_domain_validation(tls.mode != TlsMode::VerifyIdentity);
    if let Some(ca) = &tls.ca_file {
        // The configured CA alone: a certificate some public CA signed is not the shard's.
        ssl = ssl
            .with_root_certs(vec![ca.clone().into()])
            .with_disable_built_in_roots(true);
    }
    if let Some(name) = &tls.server_name {
        ssl = ssl.with_danger_tls_hostname_override(Some(name.clone()));
    }
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        ssl = ssl.with_client_identity(Some(ClientIdentity::new(
            cert.clone().into(),
            key.clone().into(),
        )));
    }
    // Through the server's socket file (which mysql_async prefers for a local server) the
    // session would skip TLS.
    Ok(opts.ssl_opts(Some(ssl)).prefer_socket(false))
}

#[cfg(not(feature = "tls"))]
fn ssl(_opts: OptsBuilder, _tls: &TlsConfig, index: usize) -> Result<OptsBuilder, ConfigError> {
    Err(ConfigError::field(
        format!("shards[{index}].tls.mode"),
        "this build of shardlock has no TLS: enable its `tls` feature",
    ))
}
