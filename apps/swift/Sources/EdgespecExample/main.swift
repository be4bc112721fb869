// edgespec-swift-example: stream one chat reply from `edgespec serve`.
//
//   swift run edgespec-swift-example [--url URL] [--max-tokens N] [--mode MODE] "Name three colours."
//   swift run edgespec-swift-example --serve /path/to/.venv/bin/edgespec [--model BUNDLE] "Hi"
//   ... --view-model    the same through ChatViewModel (the docs/swift.md app integration)
//
// The API key comes from $EDGESPEC_API_KEY (or the server started with --serve).
import EdgespecKit
import Foundation

struct Arguments {
    var url = URL(string: "http://127.0.0.1:8080")!
    var serve: String?
    var model: String?
    var maxTokens = 64
    var mode: String?
    var viewModel = false
    var prompt = "Name three colours of the rainbow."

    static func parse(_ args: [String]) -> Arguments {
        var a = Arguments()
        var words: [String] = []
        var i = 0
        func value() -> String {
            i += 1
            guard i < args.count else { fail("\(args[i - 1]) needs a value") }
            return args[i]
        }
        while i < args.count {
            switch args[i] {
            case "--url": a.url = URL(string: value()) ?? a.url
            case "--serve": a.serve = value()
            case "--model": a.model = value()
            case "--max-tokens": a.maxTokens = Int(value()) ?? a.maxTokens
            case "--mode": a.mode = value()
            case "--view-model": a.viewModel = true
            case "-h", "--help":
                print("usage: edgespec-swift-example [--url URL | --serve EDGESPEC_OR_PYTHON [--model BUNDLE]] "
                    + "[--max-tokens N] [--mode MODE] [--view-model] [PROMPT]")
                exit(0)
            default: words.append(args[i])
            }
            i += 1
        }
        if !words.isEmpty { a.prompt = words.joined(separator: " ") }
        return a
    }
}

func fail(_ message: String) -> Never {
    FileHandle.standardError.write(Data("edgespec-swift-example: \(message)\n".utf8))
    exit(1)
}

let arguments = Arguments.parse(Array(CommandLine.arguments.dropFirst()))
var client = EdgespecClient(baseURL: arguments.url, apiKey: ProcessInfo.processInfo.environment["EDGESPEC_API_KEY"])

#if os(macOS) || os(Linux)
var server: EdgespecServer?
if let launcher = arguments.serve {
    let isPython = URL(fileURLWithPath: launcher).lastPathComponent.hasPrefix("python")
    let configuration: EdgespecServer.Configuration = isPython
        ? .python(launcher, model: arguments.model) : .edgespec(launcher, model: arguments.model)
    let s = EdgespecServer(configuration: configuration)
    do {
        let url = try await s.start()
        FileHandle.standardError.write(Data("[edgespec serve on \(url)]\n".utf8))
        client = try s.client()
    } catch {
        fail("\(error.localizedDescription)")
    }
    server = s
}
#endif

let options = GenerationOptions(maxTokens: arguments.maxTokens, mode: arguments.mode.map(DecodingMode.init(rawValue:)))

if arguments.viewModel {
    guard #available(macOS 14, iOS 17, *) else { fail("--view-model needs macOS 14") }
    let model = ChatViewModel(client: client, options: options)
    model.draft = arguments.prompt
    model.send()
    await model.waitForReply()
    for turn in model.turns { print("\(turn.role.rawValue): \(turn.text)") }
    if let error = model.errorMessage { fail(error) }
    if let s = model.lastStats { print("[\(s.mode), \(String(format: "%.1f", s.tokensPerS ?? 0)) tok/s]") }
} else {
    let request = ChatRequest(messages: [.system("You are brief."), .user(arguments.prompt)], options: options)
    do {
        for try await chunk in client.streamChat(request) {
            print(chunk.text, terminator: "")
            fflush(stdout)
            if let reason = chunk.finishReason {
                print("\n[finish: \(reason)]")
            }
            if let s = chunk.edgespec {
                let rate = s.acceptanceRate.map { String(format: "%.0f%%", $0 * 100) } ?? "n/a"
                print("[mode \(s.mode), \(String(format: "%.1f", s.tokensPerS ?? 0)) tok/s, acceptance \(rate)]")
            }
            if let u = chunk.usage {
                print("[tokens: \(u.promptTokens) prompt + \(u.completionTokens) reply]")
            }
        }
    } catch {
        fail("\(error.localizedDescription)")
    }
}

#if os(macOS) || os(Linux)
await server?.stop()
#endif
