//! Certificates for TLS tests, generated per run with rcgen: a CA, a server certificate
//! for `localhost` and `127.0.0.1`, and a client certificate, written as PEM files that
//! `redis-server` and `redis-cli` read. Removed on drop.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};

/// A CA and the certificates it signed, as PEM strings and files.
pub struct TlsFiles {
    dir: PathBuf,
    pub ca_pem: String,
    pub client_cert_pem: String,
    pub client_key_pem: String,
}

impl TlsFiles {
    /// A fresh CA with a server and a client certificate, in a new directory.
    pub fn generate() -> Self {
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tollgate-tls-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the TLS test directory");

        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "tollgate test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();

        let leaf = |names: &[&str], usage: ExtendedKeyUsagePurpose| {
            let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
            let mut params = CertificateParams::new(names).unwrap();
            params
                .distinguished_name
                .push(DnType::CommonName, "tollgate test");
            params.extended_key_usages = vec![usage];
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &ca).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        // Redis nodes talk to each other (cluster bus, replication) as TLS clients too.
        let (client_cert, client_key) = leaf(&["client"], ExtendedKeyUsagePurpose::ClientAuth);

        let files = Self {
            dir,
            ca_pem: ca.pem(),
            client_cert_pem: client_cert,
            client_key_pem: client_key,
        };
        files.write("ca.crt", &files.ca_pem);
        files.write("server.crt", &server_cert);
        files.write("server.key", &server_key);
        files.write("client.crt", &files.client_cert_pem);
        files.write("client.key", &files.client_key_pem);
        files
    }

    fn write(&self, name: &str, pem: &str) {
        std::fs::write(self.dir.join(name), pem).expect("write a PEM file");
    }

    /// The path of one of the files: `ca.crt`, `server.crt`, `server.key`, `client.crt`,
    /// `client.key`.
    pub fn path(&self, name: &str) -> String {
        let path: &Path = &self.dir.join(name);
        path.to_str().expect("utf-8 temp dir").to_owned()
    }

    /// `redis-server` arguments serving TLS only on `port`; `require_client_cert` sets
    /// `tls-auth-clients yes`, else `optional`.
    pub fn server_args(&self, port: u16, require_client_cert: bool) -> Vec<String> {
        let auth = if require_client_cert {
            "yes"
        } else {
            "optional"
        };
        [
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &self.path("server.crt"),
            "--tls-key-file",
            &self.path("server.key"),
            // The node's identity when it connects to others (cluster bus, replication).
            "--tls-client-cert-file",
            &self.path("client.crt"),
            "--tls-client-key-file",
            &self.path("client.key"),
            "--tls-ca-cert-file",
            &self.path("ca.crt"),
            "--tls-auth-clients",
            auth,
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// `redis-cli` arguments for a TLS connection with the client certificate.
    pub fn cli_args(&self) -> Vec<String> {
        vec![
            "--tls".to_owned(),
            "--cacert".to_owned(),
            self.path("ca.crt"),
            "--cert".to_owned(),
            self.path("client.crt"),
            "--key".to_owned(),
            self.path("client.key"),
        ]
    }
}

impl Drop for TlsFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
