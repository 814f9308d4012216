//! Certificates for shards that speak TLS, made at test time with the `openssl` command: a CA,
//! a server certificate it signs for `localhost` only, a client certificate it signs, and a
//! second CA that signed none of them.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The files, in a temporary directory removed on drop.
#[derive(Debug)]
pub struct TestCerts {
    dir: tempfile::TempDir,
}

impl TestCerts {
    /// Makes every certificate and key (a second or so: RSA 2048 keys).
    pub fn generate() -> io::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("shardlock-certs-")
            .tempdir()?;
        let d = dir.path();
        let openssl = |args: &[&str]| -> io::Result<()> {
            let out = Command::new("openssl").args(args).current_dir(d).output()?;
            if out.status.success() {
                Ok(())
            } else {
                Err(io::Error::other(format!(
                    "openssl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                )))
            }
        };
        for ca in ["ca", "other-ca"] {
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=shardlock test {ca}"),
                "-keyout",
                &format!("{ca}-key.pem"),
                "-out",
                &format!("{ca}.pem"),
            ])?;
        }
        std::fs::write(d.join("server.ext"), "subjectAltName=DNS:localhost\n")?;
        std::fs::write(d.join("client.ext"), "extendedKeyUsage=clientAuth\n")?;
        for (who, cn) in [("server", "localhost"), ("client", "shardlock test client")] {
            openssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                &format!("/CN={cn}"),
                "-keyout",
                &format!("{who}-key.pem"),
                "-out",
                &format!("{who}.csr"),
            ])?;
            openssl(&[
                "x509",
                "-req",
                "-in",
                &format!("{who}.csr"),
                "-days",
                "2",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca-key.pem",
                "-CAcreateserial",
                "-extfile",
                &format!("{who}.ext"),
                "-out",
                &format!("{who}.pem"),
            ])?;
        }
        Ok(Self { dir })
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The CA that signed the server and client certificates.
    pub fn ca(&self) -> PathBuf {
        self.file("ca.pem")
    }

    /// A CA that signed nothing here.
    pub fn other_ca(&self) -> PathBuf {
        self.file("other-ca.pem")
    }

    /// The server certificate (for `localhost`) and its key.
    pub fn server(&self) -> (PathBuf, PathBuf) {
        (self.file("server.pem"), self.file("server-key.pem"))
    }

    /// The client certificate and its key.
    pub fn client(&self) -> (PathBuf, PathBuf) {
        (self.file("client.pem"), self.file("client-key.pem"))
    }

    /// The `mariadbd` arguments that serve TLS with the server certificate (valid for the
    /// name `localhost`, not for `127.0.0.1`) and check client certificates against the CA.
    pub fn server_args(&self) -> Vec<String> {
        let arg = |name: &str, file: &str| format!("--{name}={}", path(&self.file(file)));
        vec![
            arg("ssl-ca", "ca.pem"),
            arg("ssl-cert", "server.pem"),
            arg("ssl-key", "server-key.pem"),
        ]
    }
}

fn path(p: &Path) -> String {
    p.display().to_string()
}
