// The app integration shown in docs/swift.md: a view model that streams a reply into the
// transcript, with a Stop button that cancels it. The view model compiles everywhere
// (Observation ships with the toolchain, Linux included); the SwiftUI view where SwiftUI exists.
import EdgespecKit
import Foundation
import Observation

@available(macOS 14, iOS 17, *)
@MainActor
@Observable
final class ChatViewModel {
    struct Turn: Identifiable, Equatable {
        let id = UUID()
        let role: ChatMessage.Role
        var text: String
    }

    /// The conversation shown; the last assistant turn grows as the reply streams in.
    private(set) var turns: [Turn] = []
    /// The text field's contents.
    var draft = ""
    private(set) var isGenerating = false
    /// The last reply's decoding stats (mode, tokens/s, acceptance).
    private(set) var lastStats: EdgespecStats?
    private(set) var errorMessage: String?

    @ObservationIgnored private let client: EdgespecClient
    @ObservationIgnored private let system: String
    @ObservationIgnored var options: GenerationOptions
    @ObservationIgnored private var generation: Task<Void, Never>?

    init(client: EdgespecClient, system: String = "You are brief.", options: GenerationOptions = .init(maxTokens: 256)) {
        self.client = client
        self.system = system
        self.options = options
    }

    /// Sends the draft as the next user turn and streams the reply into the transcript.
    func send() {
        let text = draft.trimmingCharacters(in: .whitespacesAndNewlines)
        guard !text.isEmpty, !isGenerating else { return }
        draft = ""
        errorMessage = nil
        turns.append(Turn(role: .user, text: text))
        let messages = [ChatMessage.system(system)] + turns.map { ChatMessage(role: $0.role, content: $0.text) }
        turns.append(Turn(role: .assistant, text: ""))
        let reply = turns.count - 1
        let request = ChatRequest(messages: messages, options: options)
        isGenerating = true
        generation = Task { [client] in
            do {
                for try await chunk in client.streamChat(request) {
                    turns[reply].text += chunk.text
                    if let stats = chunk.edgespec { lastStats = stats }
                }
            } catch is CancellationError {
                // Stopped by the user: keep what arrived.
            } catch {
                errorMessage = error.localizedDescription
            }
            isGenerating = false
        }
    }

    /// Stops the reply: the connection closes and the server frees the model at its next token.
    func stop() {
        generation?.cancel()
    }

    /// Waits for the reply under way (for scripts and tests).
    func waitForReply() async {
        await generation?.value
    }

    func reset() {
        stop()
        turns = []
        lastStats = nil
        errorMessage = nil
    }
}

#if canImport(SwiftUI)
import SwiftUI

@available(macOS 14, iOS 17, *)
struct ChatView: View {
    @State private var model: ChatViewModel

    init(client: EdgespecClient) {
        _model = State(initialValue: ChatViewModel(client: client))
    }

    var body: some View {
        VStack(alignment: .leading, spacing: 8) {
            ScrollView {
                LazyVStack(alignment: .leading, spacing: 6) {
                    ForEach(model.turns) { turn in
                        Text(turn.text.isEmpty ? "…" : turn.text)
                            .frame(maxWidth: .infinity, alignment: turn.role == .user ? .trailing : .leading)
                            .textSelection(.enabled)
                    }
                }
            }
            if let stats = model.lastStats {
                Text("\(stats.mode), \(Int(stats.tokensPerS ?? 0)) tok/s").font(.caption).foregroundStyle(.secondary)
            }
            if let error = model.errorMessage {
                Text(error).font(.caption).foregroundStyle(.red)
            }
            HStack {
                TextField("Message", text: $model.draft)
                    .onSubmit { model.send() }
                if model.isGenerating {
                    Button("Stop") { model.stop() }
                } else {
                    Button("Send") { model.send() }
                        .disabled(model.draft.isEmpty)
                }
            }
        }
        .padding()
    }
}
#endif
