#if os(macOS) || os(Linux)
import Foundation
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Runs `edgespec serve` as a child process, for apps that ship the runtime (macOS and
/// Linux; iOS apps cannot start processes and talk to a server elsewhere).
///
/// `start()` launches it on a free loopback port (or `configuration.port`) with a random
/// API key, waits for its banner and for `/health`, and returns its URL. If the process
/// dies while running, it is started again (same port and key when the port is still
/// free), as `restartPolicy` allows. `stop()` ends it; `stopNow()` does so
/// synchronously, for `applicationWillTerminate` and the like.
///
/// ```swift
/// let server = EdgespecServer(configuration: .edgespec("/path/to/.venv/bin/edgespec", model: bundlePath))
/// try await server.start()
/// let client = try server.client()
/// ```
public final class EdgespecServer: @unchecked Sendable {
    public struct RestartPolicy: Sendable, Equatable {
        /// Restarts allowed within `window` seconds; one more death and the server is `failed`.
        public var maxRestarts: Int
        public var window: TimeInterval
        /// Pause before each restart.
        public var delay: TimeInterval

        public init(maxRestarts: Int = 5, window: TimeInterval = 300, delay: TimeInterval = 0.5) {
            self.maxRestarts = maxRestarts
            self.window = window
            self.delay = delay
        }

        public static let never = RestartPolicy(maxRestarts: 0)
    }

    public struct Configuration: Sendable {
        /// The command before `serve`: `["/path/to/edgespec"]`, or
        /// `["/path/to/python", "-m", "edgespec.cli"]`. A bare name is looked up on `PATH`.
        public var launcher: [String]
        /// `--model`: a bundle, GGUF file or Hugging Face folder; `nil` = the default model.
        public var model: String?
        /// `--drafter`: a drafter folder, `self`, `prompt_lookup` or `none`.
        public var drafter: String?
        /// `--mode`: the default decoding mode for requests that name none.
        public var mode: String?
        /// More `edgespec serve` options, e.g. `["--max-queue", "4"]`.
        public var extraArguments: [String]
        /// Added to this process's environment for the child.
        public var environment: [String: String]
        /// `nil`: a random key for each `EdgespecServer`.
        public var apiKey: String?
        public var host: String
        /// 0 = any free port.
        public var port: Int
        /// For the banner and `/health` (the first start may fetch and convert the default model).
        public var startupTimeout: TimeInterval
        public var restartPolicy: RestartPolicy
        /// Where the server's stderr is appended; its last lines are kept in `recentLog` anyway.
        public var logFile: URL?

        public init(launcher: [String], model: String? = nil, drafter: String? = nil, mode: String? = nil,
                    extraArguments: [String] = [], environment: [String: String] = [:], apiKey: String? = nil,
                    host: String = "127.0.0.1", port: Int = 0, startupTimeout: TimeInterval = 600,
                    restartPolicy: RestartPolicy = RestartPolicy(), logFile: URL? = nil)
        {
            self.launcher = launcher
            self.model = model
            self.drafter = drafter
            self.mode = mode
            self.extraArguments = extraArguments
            self.environment = environment
            self.apiKey = apiKey
            self.host = host
            self.port = port
            self.startupTimeout = startupTimeout
            self.restartPolicy = restartPolicy
            self.logFile = logFile
        }

        /// The `edgespec` command (e.g. `.venv/bin/edgespec`).
        public static func edgespec(_ executable: String = "edgespec", model: String? = nil, drafter: String? = nil,
                                    mode: String? = nil) -> Configuration
        {
            Configuration(launcher: [executable], model: model, drafter: drafter, mode: mode)
        }

        /// `python -m edgespec.cli` with a given interpreter (e.g. a venv's `bin/python`).
        public static func python(_ interpreter: String, model: String? = nil, drafter: String? = nil,
                                  mode: String? = nil) -> Configuration
        {
            Configuration(launcher: [interpreter, "-m", "edgespec.cli"], model: model, drafter: drafter, mode: mode)
        }
    }

    public enum State: Sendable, Equatable {
        case stopped
        case starting
        /// Serving at this root URL.
        case running(URL)
        /// The process died; a new one is being started.
        case restarting
        /// It could not be started, or died more often than `restartPolicy` allows.
        case failed(String)
    }

    public enum ServerError: Error, Sendable, Equatable, LocalizedError {
        case launcherNotFound(String)
        case launchFailed(String)
        case exitedDuringStartup(status: Int32, log: String)
        case startupTimedOut(log: String)
        case notRunning
        case stoppedDuringStartup

        public var errorDescription: String? {
            switch self {
            case .launcherNotFound(let name): return "edgespec launcher not found: \(name)"
            case .launchFailed(let why): return "could not start edgespec serve: \(why)"
            case .exitedDuringStartup(let status, let log):
                return "edgespec serve exited with status \(status) while starting:\n\(log)"
            case .startupTimedOut(let log): return "edgespec serve did not become healthy in time:\n\(log)"
            case .notRunning: return "edgespec serve is not running"
            case .stoppedDuringStartup: return "edgespec serve was stopped while starting"
            }
        }
    }

    public let configuration: Configuration
    /// The bearer token the child requires (given to it through `EDGESPEC_API_KEY`, so it
    /// does not show in the process list).
    public let apiKey: String

    private let lock = NSLock()
    private var _state: State = .stopped
    private var process: Process?
    private var launchCount = 0  // tells a stale exit (an earlier process's) from the current one
    private var stopping = false
    private var restartTimes: [Date] = []
    private var _restartCount = 0
    private var _lastExit: Exit?
    private var lastPort: Int?
    private var _onStateChange: (@Sendable (State) -> Void)?
    private let log = LogTail()
    private let notifications = DispatchQueue(label: "edgespec-server-state")

    public init(configuration: Configuration) {
        self.configuration = configuration
        self.apiKey = configuration.apiKey ?? Self.randomKey()
    }

    deinit {
        stopNow(timeout: 3)
    }

    // MARK: Observing

    public var state: State { locked { _state } }

    /// The server's root URL while it runs.
    public var baseURL: URL? {
        if case .running(let url) = state { return url }
        return nil
    }

    /// The current child's process id, while there is one.
    public var processIdentifier: Int32? { locked { process?.processIdentifier } }

    /// Restarts after the process died (not counting `start()` calls).
    public var restartCount: Int { locked { _restartCount } }

    /// How a child process ended: its exit status, or the signal that killed it.
    public struct Exit: Sendable, Equatable {
        public let status: Int32
        /// Killed by a signal (`status` is the signal), rather than exiting by itself.
        public let signalled: Bool
    }

    /// How the last child process ended (after `stop()`: SIGTERM, which the server handles
    /// by shutting down cleanly, then re-raises).
    public var lastExit: Exit? { locked { _lastExit } }

    /// The last lines the server wrote to stderr.
    public var recentLog: String { log.text }

    /// Called (on an arbitrary thread) on every state change.
    public var onStateChange: (@Sendable (State) -> Void)? {
        get { locked { _onStateChange } }
        set { locked { _onStateChange = newValue } }
    }

    /// A client for the running server, with its key.
    public func client(retryPolicy: RetryPolicy = .standard, timeout: TimeInterval = 600) throws -> EdgespecClient {
        guard let url = baseURL else { throw ServerError.notRunning }
        return EdgespecClient(baseURL: url, apiKey: apiKey, retryPolicy: retryPolicy, timeout: timeout)
    }

    /// Waits until the server is running (e.g. after a restart) and returns its URL.
    public func waitUntilRunning(timeout: TimeInterval = 600) async throws -> URL {
        let deadline = Date().addingTimeInterval(timeout)
        while true {
            switch state {
            case .running(let url): return url
            case .failed(let why): throw ServerError.launchFailed(why)
            case .stopped: throw ServerError.notRunning
            case .starting, .restarting: break
            }
            if Date() > deadline { throw ServerError.startupTimedOut(log: recentLog) }
            try await Task.sleep(nanoseconds: 50_000_000)
        }
    }

    // MARK: Start and stop

    /// Starts the server and returns its root URL once `/health` answers. Returns the
    /// URL at once if it is already running.
    @discardableResult
    public func start() async throws -> URL {
        let proceed: Bool = locked {
            switch _state {
            case .running, .starting, .restarting: return false
            case .stopped, .failed:
                stopping = false
                restartTimes = []
                transition(.starting)
                return true
            }
        }
        guard proceed else { return try await waitUntilRunning(timeout: configuration.startupTimeout) }
        do {
            return try await launch(port: configuration.port)
        } catch {
            locked {
                if process != nil, process?.isRunning == false { process = nil }
                if !stopping { transition(.failed("\(error.localizedDescription)")) }
            }
            throw error
        }
    }

    /// Stops the server (SIGTERM, then SIGKILL after `timeout` seconds) and waits for it to exit.
    public func stop(timeout: TimeInterval = 10) async {
        guard let p = beginStop() else { return }
        if p.isRunning { p.terminate() }
        var deadline = Date().addingTimeInterval(timeout)
        while p.isRunning && Date() < deadline {
            try? await Task.sleep(nanoseconds: 20_000_000)
        }
        if p.isRunning {
            kill(p.processIdentifier, SIGKILL)
            deadline = Date().addingTimeInterval(5)
            while p.isRunning && Date() < deadline {
                try? await Task.sleep(nanoseconds: 20_000_000)
            }
        }
        finishStop(p)
    }

    /// `stop()` without `await`, blocking the calling thread (at most `timeout` + 5 s).
    public func stopNow(timeout: TimeInterval = 5) {
        guard let p = beginStop() else { return }
        if p.isRunning { p.terminate() }
        var deadline = Date().addingTimeInterval(timeout)
        while p.isRunning && Date() < deadline { usleep(20_000) }
        if p.isRunning {
            kill(p.processIdentifier, SIGKILL)
            deadline = Date().addingTimeInterval(5)
            while p.isRunning && Date() < deadline { usleep(20_000) }
        }
        finishStop(p)
    }

    private func beginStop() -> Process? {
        locked {
            stopping = true
            if process == nil { transition(.stopped) }
            return process
        }
    }

    private func finishStop(_ p: Process) {
        locked {
            if process === p { process = nil }
            if !p.isRunning {
                _lastExit = Exit(status: p.terminationStatus, signalled: p.terminationReason == .uncaughtSignal)
            }
            transition(.stopped)
        }
    }

    // MARK: Launching

    private func launch(port: Int) async throws -> URL {
        let (executable, leading) = try resolveLauncher()
        let process = Process()
        process.executableURL = URL(fileURLWithPath: executable)
        var arguments = leading + ["serve", "--host", configuration.host, "--port", String(port)]
        if let model = configuration.model { arguments += ["--model", model] }
        if let drafter = configuration.drafter { arguments += ["--drafter", drafter] }
        if let mode = configuration.mode { arguments += ["--mode", mode] }
        process.arguments = arguments + configuration.extraArguments
        var environment = ProcessInfo.processInfo.environment
        environment.merge(configuration.environment) { _, new in new }
        environment["EDGESPEC_API_KEY"] = apiKey
        environment["PYTHONUNBUFFERED"] = "1"
        process.environment = environment
        process.standardInput = FileHandle.nullDevice
        let stdout = Pipe()
        let stderr = Pipe()
        process.standardOutput = stdout
        process.standardError = stderr

        let banner = Once<URL>()
        let launchID: Int = locked {
            launchCount += 1
            return launchCount
        }
        let log = self.log
        process.terminationHandler = { [weak self] p in
            banner.resolve(.failure(ServerError.exitedDuringStartup(status: p.terminationStatus, log: log.text)))
            self?.processExited(launchID: launchID,
                                exit: Exit(status: p.terminationStatus, signalled: p.terminationReason == .uncaughtSignal))
        }
        Self.readLines(stdout.fileHandleForReading, onEnd: {}) { line in
            if let url = Self.parseBanner(line) { banner.resolve(.success(url)) }
        }
        let stderrClosed = Flag()
        Self.readLines(stderr.fileHandleForReading, onEnd: { stderrClosed.set() }) { line in
            log.append(line)
        }
        log.file = configuration.logFile
        do {
            try Self.run(process)
        } catch {
            throw ServerError.launchFailed("\(executable): \(error.localizedDescription)")
        }
        // The child has the pipes' write ends now; close ours so EOF comes when it exits.
        try? stdout.fileHandleForWriting.close()
        try? stderr.fileHandleForWriting.close()
        let stopNow: Bool = locked {
            self.process = process
            return stopping
        }
        if stopNow {
            process.terminate()
            throw ServerError.stoppedDuringStartup
        }

        let url: URL
        do {
            url = try await waitUntilReady(process, banner: banner)
        } catch ServerError.exitedDuringStartup(let status, _) {
            // Its last words may still be in the pipe: wait (briefly) for stderr to close.
            let deadline = Date().addingTimeInterval(3)
            while !stderrClosed.isSet && Date() < deadline { try? await Task.sleep(nanoseconds: 20_000_000) }
            locked { if self.process === process { self.process = nil } }
            throw ServerError.exitedDuringStartup(status: status, log: log.text)
        } catch {
            if process.isRunning { process.terminate() }  // half started: never leave it behind
            throw error
        }
        let stoppedMeanwhile: Bool = locked {
            if stopping || self.process !== process { return true }
            transition(.running(url))
            lastPort = url.port
            return false
        }
        if stoppedMeanwhile { throw ServerError.stoppedDuringStartup }
        return url
    }

    /// The banner (with the port), then `/health`.
    private func waitUntilReady(_ process: Process, banner: Once<URL>) async throws -> URL {
        let deadline = Date().addingTimeInterval(configuration.startupTimeout)
        let log = self.log
        let url = try await banner.wait(timeout: configuration.startupTimeout,
                                        onTimeout: ServerError.startupTimedOut(log: log.text))
        let probe = EdgespecClient(baseURL: url, apiKey: apiKey, retryPolicy: .none, timeout: 10)
        while true {
            if !process.isRunning {
                throw ServerError.exitedDuringStartup(status: process.terminationStatus, log: log.text)
            }
            if (try? await probe.health()) != nil { return url }
            if Date() > deadline { throw ServerError.startupTimedOut(log: log.text) }
            try await Task.sleep(nanoseconds: 100_000_000)
        }
    }

    private func processExited(launchID: Int, exit: Exit) {
        let restart: Bool = locked {
            _lastExit = exit
            guard launchID == launchCount else { return false }  // an earlier process
            process = nil
            if stopping {
                transition(.stopped)
                return false
            }
            if case .running = _state { return true }
            return false  // died while starting: launch() reports it
        }
        if restart { scheduleRestart() }
    }

    private func scheduleRestart() {
        let policy = configuration.restartPolicy
        let now = Date()
        let go: Bool = locked {
            if stopping { return false }
            restartTimes = restartTimes.filter { now.timeIntervalSince($0) < policy.window }
            if restartTimes.count >= policy.maxRestarts {
                transition(.failed("edgespec serve died \(restartTimes.count + 1) times within \(Int(policy.window)) s"))
                return false
            }
            restartTimes.append(now)
            _restartCount += 1
            transition(.restarting)
            return true
        }
        guard go else { return }
        let port = locked { lastPort }
        Task { [weak self] in
            try? await Task.sleep(nanoseconds: UInt64(policy.delay * 1_000_000_000))
            await self?.relaunch(preferredPort: port)
        }
    }

    private func relaunch(preferredPort: Int?) async {
        if locked({ stopping }) { return }
        // The same port first, so clients holding the old URL keep working; if something
        // else took it meanwhile, the configured one (0: any free port).
        var ports = [configuration.port]
        if let preferredPort, preferredPort != configuration.port { ports.insert(preferredPort, at: 0) }
        for port in ports {
            do {
                _ = try await launch(port: port)
                return
            } catch {
                if locked({ stopping }) { return }
            }
        }
        scheduleRestart()
    }

    // MARK: Helpers

    private func locked<T>(_ body: () throws -> T) rethrows -> T {
        lock.lock()
        defer { lock.unlock() }
        return try body()
    }

    /// Sets the state (call with the lock held). Observers are told in order, on a queue
    /// of their own, so they may read `state` without deadlocking.
    private func transition(_ new: State) {
        guard new != _state else { return }
        _state = new
        if let observer = _onStateChange {
            notifications.async { observer(new) }
        }
    }

    private func resolveLauncher() throws -> (String, [String]) {
        guard let first = configuration.launcher.first else { throw ServerError.launcherNotFound("(empty launcher)") }
        let rest = Array(configuration.launcher.dropFirst())
        if first.contains("/") {
            guard FileManager.default.isExecutableFile(atPath: first) else { throw ServerError.launcherNotFound(first) }
            return (first, rest)
        }
        let path = configuration.environment["PATH"] ?? ProcessInfo.processInfo.environment["PATH"] ?? ""
        for dir in path.split(separator: ":") {
            let candidate = String(dir) + "/" + first
            if FileManager.default.isExecutableFile(atPath: candidate) { return (candidate, rest) }
        }
        throw ServerError.launcherNotFound(first)
    }

    /// Starts `process` from a thread of its own with no signal blocked. A child inherits
    /// the signal mask of the thread that spawns it, and the threads Swift concurrency and
    /// Dispatch run on block most signals: a server started from one of them would never
    /// see the SIGTERM that asks it to shut down cleanly.
    private static func run(_ process: Process) throws {
        final class Outcome: @unchecked Sendable {
            var error: Error?
            let done = DispatchSemaphore(value: 0)
        }
        let outcome = Outcome()
        let thread = Thread {
            var none = sigset_t()
            sigemptyset(&none)
            pthread_sigmask(SIG_SETMASK, &none, nil)
            do {
                try process.run()
            } catch {
                outcome.error = error
            }
            outcome.done.signal()
        }
        thread.name = "edgespec-serve-spawn"
        thread.start()
        outcome.done.wait()
        if let error = outcome.error { throw error }
    }

    /// `edgespec serve: <model id> on http://127.0.0.1:<port>/v1` -> the root URL.
    static func parseBanner(_ line: String) -> URL? {
        guard line.hasPrefix("edgespec serve:"), let at = line.range(of: " on http://") else { return nil }
        let address = line[line.index(at.lowerBound, offsetBy: 4)...].trimmingCharacters(in: .whitespaces)
        guard let url = URL(string: address), url.port != nil else { return nil }
        return EdgespecClient.root(of: url)
    }

    static func randomKey() -> String {
        var rng = SystemRandomNumberGenerator()
        return "es-" + (0..<4).map { _ in String(format: "%016llx", rng.next() as UInt64) }.joined()
    }

    /// Reads a pipe on its own thread until EOF, calling `onLine` for each line.
    private static func readLines(_ handle: FileHandle, onEnd: @escaping @Sendable () -> Void,
                                  onLine: @escaping @Sendable (String) -> Void)
    {
        let thread = Thread {
            var buffer = Data()
            while true {
                let piece = handle.availableData
                if piece.isEmpty { break }
                buffer.append(piece)
                while let newline = buffer.firstIndex(of: UInt8(ascii: "\n")) {
                    onLine(String(decoding: buffer[buffer.startIndex..<newline], as: UTF8.self))
                    buffer.removeSubrange(buffer.startIndex...newline)
                }
            }
            if !buffer.isEmpty { onLine(String(decoding: buffer, as: UTF8.self)) }
            try? handle.close()
            onEnd()
        }
        thread.name = "edgespec-serve-output"
        thread.start()
    }
}

/// A value that is set once, and awaited (with a timeout).
private final class Once<Value: Sendable>: @unchecked Sendable {
    private let lock = NSLock()
    private var result: Result<Value, Error>?
    private var waiter: CheckedContinuation<Value, Error>?

    func resolve(_ value: Result<Value, Error>) {
        lock.lock()
        guard result == nil else {
            lock.unlock()
            return
        }
        result = value
        let w = waiter
        waiter = nil
        lock.unlock()
        w?.resume(with: value)
    }

    func wait(timeout: TimeInterval, onTimeout: @autoclosure @escaping @Sendable () -> Error) async throws -> Value {
        DispatchQueue.global().asyncAfter(deadline: .now() + timeout) { [weak self] in
            self?.resolve(.failure(onTimeout()))
        }
        return try await withCheckedThrowingContinuation { continuation in
            lock.lock()
            if let result {
                lock.unlock()
                continuation.resume(with: result)
            } else {
                waiter = continuation
                lock.unlock()
            }
        }
    }
}

private final class Flag: @unchecked Sendable {
    private let lock = NSLock()
    private var value = false
    func set() { lock.lock(); value = true; lock.unlock() }
    var isSet: Bool { lock.lock(); defer { lock.unlock() }; return value }
}

/// The last 16 KiB of the server's stderr, and optionally a log file.
private final class LogTail: @unchecked Sendable {
    private let lock = NSLock()
    private var lines: [String] = []
    private var size = 0
    private var handle: FileHandle?
    private var _file: URL?

    var file: URL? {
        get { lock.lock(); defer { lock.unlock() }; return _file }
        set {
            lock.lock()
            defer { lock.unlock() }
            guard newValue != _file else { return }
            try? handle?.close()
            handle = nil
            _file = newValue
            if let url = newValue {
                if !FileManager.default.fileExists(atPath: url.path) {
                    _ = FileManager.default.createFile(atPath: url.path, contents: nil)
                }
                handle = try? FileHandle(forWritingTo: url)
                _ = try? handle?.seekToEnd()
            }
        }
    }

    func append(_ line: String) {
        lock.lock()
        defer { lock.unlock() }
        lines.append(line)
        size += line.utf8.count + 1
        while size > 16 * 1024, lines.count > 1 {
            size -= lines.removeFirst().utf8.count + 1
        }
        if let handle { try? handle.write(contentsOf: Data((line + "\n").utf8)) }
    }

    var text: String {
        lock.lock()
        defer { lock.unlock() }
        return lines.joined(separator: "\n")
    }
}
#endif
